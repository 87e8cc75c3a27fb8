//! Routing policies: which backend gets a request, and in what order the others are tried.
//!
//! A policy is a synchronous, pure function of one snapshot row per candidate
//! ([`CandidateRow`]) and the request's facts ([`RequestFacts`]): it does no I/O and reads no
//! live counters, so its tests write rows. Each policy lives in its own file with its settings;
//! [`build`] makes the configured one.

mod cost;
mod least_loaded;
pub mod order;
mod prefix;
mod prefix_load;
mod round_robin;
mod session;

#[cfg(test)]
pub(crate) mod fixtures;

use prefix_index::ServerId;

pub use cost::{predicted_ttft, prefill_work, queue_wait, ttft_after_queue, ttft_of_work, Cost};
pub use least_loaded::LeastLoaded;
pub use prefix::Prefix;
pub use prefix_load::PrefixLoad;
pub use round_robin::RoundRobin;
pub use session::Session;

/// `--policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[clap(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each request to the next backend in turn.
    RoundRobin,
    /// Fewest requests in flight at this router, then fewest running and waiting at the
    /// backend.
    LeastLoaded,
    /// Requests with the same `--session-header` to the same backend (rendezvous hashing with
    /// bounded load); without the header, least loaded.
    Session,
    /// The backend holding the longest prefix; ties to the least loaded.
    Prefix,
    /// Longest prefix unless the match is below `--cache-threshold` or the backend is too far
    /// above the least loaded one (`--balance-abs` and `--balance-rel`); then least loaded.
    PrefixLoad,
    /// The lowest predicted time to first token: prefill work queued there plus this
    /// request's uncached tokens, through each backend's prefill speed learned from its TTFTs.
    Cost,
}

impl PolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::LeastLoaded => "least_loaded",
            Self::Session => "session",
            Self::Prefix => "prefix",
            Self::PrefixLoad => "prefix_load",
            Self::Cost => "cost",
        }
    }
}

/// The policies' settings, from the command line or the config file.
#[derive(Clone, Copy, Debug)]
pub struct PolicySettings {
    pub kind: PolicyKind,
    pub cache_threshold: f64,
    pub balance_abs: u64,
    pub balance_rel: f64,
    /// Bounded load of the session policy: no backend above this times its share of the load.
    pub session_load_factor: f64,
}

/// The configured policy.
pub fn build(settings: &PolicySettings) -> Box<dyn Policy> {
    match settings.kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin),
        PolicyKind::LeastLoaded => Box::new(LeastLoaded),
        PolicyKind::Session => Box::new(Session {
            load_factor: settings.session_load_factor,
        }),
        PolicyKind::Prefix => Box::new(Prefix),
        PolicyKind::PrefixLoad => Box::new(PrefixLoad {
            cache_threshold: settings.cache_threshold,
            balance_abs: settings.balance_abs,
            balance_rel: settings.balance_rel,
        }),
        PolicyKind::Cost => Box::new(Cost {
            balance_abs: settings.balance_abs,
            balance_rel: settings.balance_rel,
        }),
    }
}

/// One candidate backend as a policy sees it: a snapshot taken for one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CandidateRow {
    pub id: ServerId,
    /// Relative capacity (at least 1): load is compared per unit of weight.
    pub weight: u64,
    /// Requests this router has in flight there.
    pub inflight: u64,
    /// Of those, the ones still waiting for their first byte: the prefill queue ahead.
    pub waiting_first_byte: u64,
    /// Running + waiting requests the backend itself reports.
    pub queue: u64,
    /// Entries the string index holds for it (new prefixes go where it is emptiest).
    pub entries: u64,
    /// Leading tokens of this request it holds (0 unless the policy asked for matches).
    pub matched_tokens: u64,
    /// Uncached prompt tokens of the requests this router sent there that have not started
    /// answering: the prefill work ahead of a new request.
    pub queued_prefill_tokens: u64,
    /// Requests waiting at the backend that this router (and its replicas) did not send: its
    /// reported waiting count less ours at the time of that report.
    pub foreign_waiting: u64,
    /// Its KV cache's usage, 0..1, as it reports it.
    pub kv_usage: f64,
    /// KV-cache tokens in use there now (the others' as last reported, ours live)...
    pub kv_tokens_in_use: u64,
    /// ... of this many (0 while unknown).
    pub kv_cache_tokens: u64,
    /// Its prefill speed as learned from its TTFTs...
    pub prefill: crate::core::prefill::PrefillLine,
    /// ... from this many of them.
    pub prefill_observations: u64,
    /// Seconds its waiting requests (ours) have gone without a first byte (since the last one
    /// came, or since the first of them was sent): the queue there has been worked on that
    /// long, and past the line's time for it the backend is late ([`ttft_after_queue`]).
    pub stalled_secs: f64,
    /// Which index answered `matched_tokens` for it.
    pub matched_by: MatchedBy,
}

/// Which index a row's match came from (a decision's `index` label).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatchedBy {
    /// No index answered (the policy does not match, or both failed).
    #[default]
    None,
    /// The string index.
    Strings,
    /// The backend's KV events (precise mode).
    Events,
}

impl MatchedBy {
    pub fn label(self) -> &'static str {
        match self {
            MatchedBy::None => "none",
            MatchedBy::Strings => "strings",
            MatchedBy::Events => "events",
        }
    }
}

/// What the match sources said about a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MatchFacts {
    /// The policy does not use matches, or the request has nothing to match.
    None,
    /// The request has `total_tokens`; each row's `matched_tokens` is filled in.
    Known { total_tokens: u64 },
    /// The index failed or timed out: route by load.
    Unavailable,
}

/// The request's facts besides the rows.
#[derive(Clone, Copy, Debug)]
pub struct RequestFacts<'a> {
    /// The session key (`--session-header`), if the request carries one.
    pub session: Option<&'a str>,
    pub matches: MatchFacts,
    /// A rotating position, so that equally loaded backends take turns.
    pub turn: u64,
    /// This router's rank among the live router replicas (0 without peers). A new prompt goes
    /// to the least loaded backend; replicas with the same view would all name the same one
    /// (the load order breaks its ties by index entries, which they all count alike), so
    /// replica `rank` takes the `rank`-th of the near-equal ones: a burst fanned out over the
    /// replicas at one moment lands on as many backends.
    pub replica_rank: u32,
}

/// Why a backend was chosen (a label of `prefix_router_routing_decisions_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    RoundRobin,
    LeastLoaded,
    SessionAffinity,
    SessionOverflow,
    NoSession,
    CacheHit,
    BelowThreshold,
    LoadGuard,
    /// The store failed or timed out: routed by load.
    StoreUnavailable,
    /// The cost policy chose a backend holding the longest match.
    CostHit,
    /// The cost policy chose a backend with less of a match: its queue made it faster.
    CostBalance,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::LeastLoaded => "least_loaded",
            Self::SessionAffinity => "session_affinity",
            Self::SessionOverflow => "session_overflow",
            Self::NoSession => "no_session",
            Self::CacheHit => "cache_hit",
            Self::BelowThreshold => "below_threshold",
            Self::LoadGuard => "load_guard",
            Self::StoreUnavailable => "store_unavailable",
            Self::CostHit => "cost_hit",
            Self::CostBalance => "cost_balance",
        }
    }
}

/// A policy's answer: every candidate once, in the order to try them (positions in the rows
/// given), and why the first.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub order: Vec<usize>,
    pub reason: Reason,
    /// Matched ÷ request tokens of the chosen backend (prefix policies).
    pub matched_ratio: Option<f64>,
}

/// A routing policy.
pub trait Policy: Send + Sync {
    /// Its name in `--policy` and in metrics.
    fn name(&self) -> &'static str;
    /// Whether it needs each candidate's matched tokens (the core asks the index only then).
    fn needs_matches(&self) -> bool {
        false
    }
    /// Orders the candidates (never empty) for one request.
    fn choose(&self, rows: &[CandidateRow], facts: &RequestFacts) -> Choice;
}

/// Logs one decision with what each candidate looked like (`--log prefix_router::decision=debug`),
/// first the chosen one: how a user (or we) finds out why a request went where it went. Per
/// candidate: server id, matched tokens, requests in flight (of them waiting for a first byte),
/// queued prefill tokens, seconds the queue has been under way, the TTFT `cost` predicts and the
/// delay it would impose on the requests waiting there ([`cost::predicted_ttfts`], whatever the
/// policy).
pub fn explain(policy: &dyn Policy, rows: &[CandidateRow], facts: &RequestFacts, choice: &Choice) {
    let total = match facts.matches {
        MatchFacts::Known { total_tokens } => total_tokens,
        _ => 0,
    };
    let predicted = cost::predicted_ttfts(rows, total);
    let candidates: Vec<String> = choice
        .order
        .iter()
        .map(|&p| {
            let r = &rows[p];
            format!(
                "{} m{} f{}/{} q{} u{:.0}ms p{:.0}ms d{:.0}ms",
                r.id,
                r.matched_tokens,
                r.waiting_first_byte,
                r.inflight,
                r.queued_prefill_tokens,
                r.stalled_secs * 1e3,
                predicted[p].0 * 1e3,
                predicted[p].1 * 1e3,
            )
        })
        .collect();
    tracing::debug!(
        target: "prefix_router::decision",
        policy = policy.name(),
        reason = choice.reason.label(),
        tokens = total,
        ?candidates,
        "decided"
    );
}
