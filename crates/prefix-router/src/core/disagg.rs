//! Prefill/decode disaggregation: the decode server first, then whether a prefill server
//! computes the prompt for it.
//!
//! A disaggregated fleet has servers that prefill (`prefill`), servers that decode (`decode`)
//! and servers that do both. The decode server holds the request for its whole answer, so it
//! is chosen first, by the active policy over the decode pool: its prefix affinity is what
//! saves the most, since a prompt it holds needs no prefill anywhere. Then:
//!
//! - what the decode server lacks of the prompt is at most `--pd-threshold` tokens: it computes
//!   that itself (`pd_skip_cached`) — a short prefill disturbs its decoding less than a
//!   transfer's round trip costs the request;
//! - the prefill pool is saturated (every prefill server's queue alone outlasts the decode
//!   server's whole prefill of the request) and the decode server is not: it computes it
//!   itself (`pd_skip_saturated`);
//! - otherwise a prefill server, chosen by the same policy among the prefill pool (prefix and
//!   load), computes the prompt and the decode server pulls its KV blocks
//!   (`pd_disaggregated`).

use std::sync::Arc;

use super::backend::Backend;
use super::policy::{predicted_ttft, queue_wait, CandidateRow, MatchFacts, Policy, RequestFacts};

/// What a server does in a disaggregated fleet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Role {
    /// Prefill and decode alike (every server of an aggregated fleet).
    #[default]
    Both,
    /// Computes prompts for decode servers.
    Prefill,
    /// Answers requests, pulling their prompts' KV blocks from a prefill server.
    Decode,
}

impl Role {
    /// From a config value or a pod label (llm-d's values: `prefill`, `decode`, `both`, and
    /// `prefill-decode` for both).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "both" | "prefill-decode" | "prefill_decode" | "" => Some(Role::Both),
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// Whether it may answer a request (hold its decode).
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }

    /// Whether it may prefill for another server.
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }
}

/// `--pd-threshold`: the most uncached tokens a decode server computes itself.
#[derive(Clone, Copy, Debug)]
pub struct PdSettings {
    pub threshold: u64,
}

/// Whether a prefill server computes the prompt, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PdOutcome {
    /// A prefill server computes it; the decode server pulls the blocks.
    Disaggregated,
    /// The decode server lacks at most `--pd-threshold` tokens of it.
    SkipCached,
    /// Every prefill server is busier than the decode server's own prefill would take.
    SkipSaturated,
    /// No prefill server is healthy (or the only one is the decode server itself).
    SkipNoPrefill,
}

impl PdOutcome {
    /// Its `reason` in the decisions counter.
    pub fn label(self) -> &'static str {
        match self {
            PdOutcome::Disaggregated => "pd_disaggregated",
            PdOutcome::SkipCached => "pd_skip_cached",
            PdOutcome::SkipSaturated => "pd_skip_saturated",
            PdOutcome::SkipNoPrefill => "pd_skip_no_prefill",
        }
    }
}

/// The prefill servers to try for a request, in order, with what each lacks of its prompt.
#[derive(Clone, Debug)]
pub struct PrefillPlan {
    pub order: Vec<Arc<Backend>>,
    pub uncached: Vec<u64>,
}

/// Decides, for a request whose decode server is `decode` (its row), whether and where it is
/// prefilled: `prefill` are the prefill candidates (the decode server not among them) with
/// their rows. Returns the outcome and, when disaggregated, the order of prefill servers.
pub fn plan_prefill(
    policy: &dyn Policy,
    settings: PdSettings,
    decode: &CandidateRow,
    prefill: (&[Arc<Backend>], &[CandidateRow]),
    facts: &RequestFacts,
) -> (PdOutcome, Option<PrefillPlan>) {
    let (backends, rows) = prefill;
    if backends.is_empty() {
        return (PdOutcome::SkipNoPrefill, None);
    }
    let total = match facts.matches {
        MatchFacts::Known { total_tokens } => Some(total_tokens),
        _ => None,
    };
    if let Some(total) = total {
        let lacking = total.saturating_sub(decode.matched_tokens);
        if lacking <= settings.threshold {
            return (PdOutcome::SkipCached, None);
        }
        let own = predicted_ttft(decode, lacking);
        let least_wait = rows.iter().map(queue_wait).fold(f64::MAX, f64::min);
        if least_wait > own && queue_wait(decode) < least_wait {
            return (PdOutcome::SkipSaturated, None);
        }
    }
    let choice = policy.choose(rows, facts);
    let uncached = match total {
        Some(total) => choice
            .order
            .iter()
            .map(|&p| total.saturating_sub(rows[p].matched_tokens))
            .collect(),
        None => Vec::new(),
    };
    let order = choice.order.iter().map(|&p| backends[p].clone()).collect();
    (
        PdOutcome::Disaggregated,
        Some(PrefillPlan { order, uncached }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::backend::BackendSpec;
    use crate::core::policy::fixtures::{known, matched, rows};
    use crate::core::prefill::PrefillLine;

    fn backends(n: usize) -> Vec<Arc<Backend>> {
        (0..n)
            .map(|i| {
                Arc::new(
                    Backend::new(BackendSpec::new(&format!("http://p{i}:8000")), 1000).unwrap(),
                )
            })
            .collect()
    }

    /// 10 ms + 10,000 tokens/s everywhere.
    fn lined(mut r: Vec<CandidateRow>) -> Vec<CandidateRow> {
        for row in &mut r {
            row.prefill = PrefillLine {
                overhead_s: 0.01,
                seconds_per_token: 1e-4,
            };
        }
        r
    }

    fn policy() -> crate::core::policy::Cost {
        crate::core::policy::Cost {
            balance_abs: 16,
            balance_rel: 1.5,
        }
    }

    /// The plan for a 4,000-token request with the default threshold.
    fn plan(
        decode: &CandidateRow,
        prefill: &[Arc<Backend>],
        rows: &[CandidateRow],
    ) -> (PdOutcome, Option<PrefillPlan>) {
        plan_prefill(
            &policy(),
            PdSettings { threshold: 512 },
            decode,
            (prefill, rows),
            &known(4000, 0),
        )
    }

    #[test]
    fn roles_parse_as_llm_d_labels_them() {
        assert_eq!(Role::parse("prefill"), Some(Role::Prefill));
        assert_eq!(Role::parse("Decode"), Some(Role::Decode));
        assert_eq!(Role::parse("prefill-decode"), Some(Role::Both));
        assert_eq!(Role::parse("both"), Some(Role::Both));
        assert_eq!(Role::parse("encode"), None);
        assert!(Role::Both.decodes() && Role::Both.prefills());
        assert!(!Role::Prefill.decodes() && !Role::Decode.prefills());
    }

    #[test]
    fn a_decode_server_holding_the_prompt_computes_the_rest_itself() {
        let decode = lined(matched(rows(1), &[3600])).remove(0);
        let p = backends(2);
        let prefill_rows = lined(rows(2));
        // 4,000 tokens, 3,600 held: 400 to compute, under the threshold.
        let (outcome, planned) = plan(&decode, &p, &prefill_rows);
        assert_eq!((outcome, planned.is_none()), (PdOutcome::SkipCached, true));
        // 3,000 held: 1,000 to compute, over it: a prefill server computes it.
        let decode = lined(matched(rows(1), &[3000])).remove(0);
        let (outcome, planned) = plan(&decode, &p, &prefill_rows);
        assert_eq!(outcome, PdOutcome::Disaggregated);
        assert_eq!(planned.unwrap().order.len(), 2);
    }

    #[test]
    fn the_prefill_server_is_chosen_by_prefix_and_load() {
        let decode = lined(rows(1)).remove(0);
        let p = backends(3);
        // Prefill server 2 holds 3,000 of the 4,000 tokens.
        let prefill_rows = lined(matched(rows(3), &[0, 0, 3000]));
        let (_, planned) = plan(&decode, &p, &prefill_rows);
        let planned = planned.unwrap();
        assert_eq!(planned.order[0].url(), p[2].url());
        assert_eq!(planned.uncached[0], 1000);
    }

    #[test]
    fn a_saturated_prefill_pool_is_skipped_while_the_decode_server_is_free() {
        let decode = lined(rows(1)).remove(0);
        let p = backends(2);
        let mut prefill_rows = lined(rows(2));
        // 20,000 tokens queued at each prefill server: 2 s of waiting, against 0.41 s to
        // compute the 4,000 tokens on the idle decode server.
        for r in &mut prefill_rows {
            r.queued_prefill_tokens = 20_000;
            r.waiting_first_byte = 3;
        }
        let (outcome, _) = plan(&decode, &p, &prefill_rows);
        assert_eq!(outcome, PdOutcome::SkipSaturated);
        // One prefill server with room: disaggregated.
        prefill_rows[1].queued_prefill_tokens = 0;
        prefill_rows[1].waiting_first_byte = 0;
        let (outcome, planned) = plan(&decode, &p, &prefill_rows);
        assert_eq!(outcome, PdOutcome::Disaggregated);
        assert_eq!(planned.unwrap().order[0].url(), p[1].url());
    }

    #[test]
    fn without_prefill_servers_the_decode_server_prefills() {
        let decode = lined(rows(1)).remove(0);
        let (outcome, planned) = plan(&decode, &[], &[]);
        assert_eq!(
            (outcome, planned.is_none()),
            (PdOutcome::SkipNoPrefill, true)
        );
    }
}
