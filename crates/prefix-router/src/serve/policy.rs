//! Routing policies: which backend gets a request, and in what order the others are tried.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use prefix_index::{PrefixHashes, QueryOutcome, ServerId};

use super::backend::Backend;

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
}

impl PolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::LeastLoaded => "least_loaded",
            Self::Session => "session",
            Self::Prefix => "prefix",
            Self::PrefixLoad => "prefix_load",
        }
    }

    pub fn uses_prefixes(self) -> bool {
        matches!(self, Self::Prefix | Self::PrefixLoad)
    }
}

/// Thresholds of the policies.
#[derive(Clone, Copy, Debug)]
pub struct PolicySettings {
    pub kind: PolicyKind,
    pub cache_threshold: f64,
    pub balance_abs: u64,
    pub balance_rel: f64,
    /// Bounded load of the session policy: no backend above this times the mean load.
    pub session_load_factor: f64,
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
        }
    }
}

/// The outcome: backends in the order to try them (the chosen one first).
#[derive(Debug)]
pub struct Decision {
    pub order: Vec<Arc<Backend>>,
    pub reason: Reason,
    /// Matched chunks ÷ request chunks of the chosen backend (prefix policies).
    pub matched_ratio: Option<f64>,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend").field("url", &self.url()).finish()
    }
}

/// Orders candidates by load: in-flight here, then the backend's own queue, then index entries
/// (so new prefixes go where the index is emptiest), each divided by the backend's weight, then
/// a rotating position (so equal backends take turns).
pub fn by_load(candidates: &mut [Arc<Backend>], rotation: u64) {
    order(candidates, rotation, false)
}

/// Like [`by_load`], but first by requests still waiting for their first byte: the prefill
/// queue, which is what a new request's time to first token waits behind (decoding requests
/// barely delay it). The prefix policies place requests that have no useful match this way.
pub fn by_prefill_load(candidates: &mut [Arc<Backend>], rotation: u64) {
    order(candidates, rotation, true)
}

fn order(candidates: &mut [Arc<Backend>], rotation: u64, prefill_first: bool) {
    let n = candidates.len() as u64;
    if n < 2 {
        return;
    }
    /// (waiting for first byte, in flight, backend queue, index entries, turn)
    type LoadKey = (u64, u64, u64, u64, u64);
    let mut keyed: Vec<(LoadKey, Arc<Backend>)> = candidates
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let (inflight, queue) = b.load();
            // A backend of weight 2 takes twice the requests of a backend of weight 1.
            let weight = b.weight();
            let prefill = if prefill_first {
                b.waiting_first_byte.load(Relaxed) * 1024 / weight
            } else {
                0
            };
            let turn = (i as u64 + n - rotation % n) % n;
            let key = (
                prefill,
                inflight * 1024 / weight,
                queue * 1024 / weight,
                b.entries.load(Relaxed) / weight,
                turn,
            );
            (key, b.clone())
        })
        .collect();
    keyed.sort_unstable_by_key(|(k, _)| *k);
    for (slot, (_, b)) in candidates.iter_mut().zip(keyed) {
        *slot = b;
    }
}

/// Decides where requests go.
pub struct Balancer {
    pub settings: PolicySettings,
    turn: AtomicU64,
}

/// Why the store could not answer: the caller routes by load and counts it.
pub struct StoreFailure;

impl Balancer {
    pub fn new(settings: PolicySettings) -> Self {
        Self {
            settings,
            turn: AtomicU64::new(0),
        }
    }

    /// A rotating position, so equally loaded backends take turns.
    pub fn next_turn(&self) -> u64 {
        self.turn.fetch_add(1, Relaxed)
    }

    /// Orders `candidates` (healthy backends serving the model, non-empty) for a request.
    /// `query` asks the prefix store (only called by prefix policies, with the candidates'
    /// ids in load order).
    pub async fn decide<Q, F>(
        &self,
        mut candidates: Vec<Arc<Backend>>,
        hashes: Option<&PrefixHashes>,
        session: Option<&str>,
        query: Q,
    ) -> Decision
    where
        Q: FnOnce(Vec<ServerId>) -> F,
        F: std::future::Future<Output = Result<QueryOutcome, StoreFailure>>,
    {
        let turn = self.next_turn();
        let s = &self.settings;
        match s.kind {
            PolicyKind::RoundRobin => {
                let n = candidates.len();
                candidates.rotate_left((turn % n as u64) as usize);
                // Fallbacks by load.
                by_load(&mut candidates[1..], turn);
                decision(candidates, Reason::RoundRobin, None)
            }
            PolicyKind::LeastLoaded => {
                by_load(&mut candidates, turn);
                decision(candidates, Reason::LeastLoaded, None)
            }
            PolicyKind::Session => {
                by_load(&mut candidates, turn);
                match session {
                    None => decision(candidates, Reason::NoSession, None),
                    Some(key) => self.session(candidates, key),
                }
            }
            PolicyKind::Prefix | PolicyKind::PrefixLoad => {
                by_prefill_load(&mut candidates, turn);
                if hashes.is_none_or(|h| h.is_empty()) {
                    return decision(candidates, Reason::BelowThreshold, Some(0.0));
                };
                let ids = candidates.iter().map(|b| b.id).collect();
                match query(ids).await {
                    Err(StoreFailure) => decision(candidates, Reason::StoreUnavailable, None),
                    Ok(q) => self.prefix_choice(candidates, &q),
                }
            }
        }
    }

    fn prefix_choice(&self, mut candidates: Vec<Arc<Backend>>, q: &QueryOutcome) -> Decision {
        let s = &self.settings;
        let best = q
            .matches
            .iter()
            .enumerate()
            .max_by_key(|&(i, &m)| (m, std::cmp::Reverse(i)))
            .map_or(0, |(i, _)| i);
        let ratio = if q.total == 0 {
            0.0
        } else {
            q.matches[best] as f64 / q.total as f64
        };
        if s.kind == PolicyKind::Prefix {
            candidates[..=best].rotate_right(1);
            return decision(candidates, Reason::CacheHit, Some(ratio));
        }
        if ratio < s.cache_threshold || q.matches[best] == 0 {
            return decision(candidates, Reason::BelowThreshold, Some(ratio));
        }
        // In requests per unit of weight: a backend of weight 4 at 40 is as loaded as one of
        // weight 1 at 10.
        let chosen = per_weight(&candidates[best]);
        let least = candidates
            .iter()
            .map(|b| per_weight(b))
            .fold(f64::MAX, f64::min);
        let overloaded = chosen > least + s.balance_abs as f64 && chosen > least * s.balance_rel;
        if overloaded {
            return decision(candidates, Reason::LoadGuard, Some(ratio));
        }
        candidates[..=best].rotate_right(1);
        decision(candidates, Reason::CacheHit, Some(ratio))
    }

    /// Rendezvous hashing: every backend gets a score from (key, backend id); the highest
    /// score wins unless its load is above `session_load_factor` × its share of the total (+1)
    /// by weight, then the next.
    fn session(&self, candidates: Vec<Arc<Backend>>, key: &str) -> Decision {
        let key_hash = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
        let total: u64 = candidates.iter().map(|b| b.inflight.load(Relaxed)).sum();
        let total_weight: u64 = candidates.iter().map(|b| b.weight()).sum();
        let per_weight_bound =
            (total + 1) as f64 / total_weight as f64 * self.settings.session_load_factor;
        let bound = |b: &Backend| ((per_weight_bound * b.weight() as f64).ceil() as u64).max(1);
        let mut ranked = candidates.clone();
        ranked.sort_by_key(|b| {
            std::cmp::Reverse(xxhash_rust::xxh3::xxh3_64_with_seed(
                &b.id.to_le_bytes(),
                key_hash,
            ))
        });
        let pick = ranked
            .iter()
            .position(|b| b.inflight.load(Relaxed) < bound(b))
            .unwrap_or(0);
        let reason = if pick == 0 {
            Reason::SessionAffinity
        } else {
            Reason::SessionOverflow
        };
        let chosen = ranked[pick].clone();
        let mut order = vec![chosen.clone()];
        order.extend(candidates.into_iter().filter(|b| !Arc::ptr_eq(b, &chosen)));
        decision(order, reason, None)
    }
}

/// In-flight requests per unit of weight.
fn per_weight(b: &Backend) -> f64 {
    b.inflight.load(Relaxed) as f64 / b.weight() as f64
}

fn decision(order: Vec<Arc<Backend>>, reason: Reason, matched_ratio: Option<f64>) -> Decision {
    Decision {
        order,
        reason,
        matched_ratio,
    }
}

#[cfg(test)]
mod tests {
    use super::super::backend::BackendSpec;
    use super::*;

    fn backends(n: usize) -> Vec<Arc<Backend>> {
        (0..n)
            .map(|i| {
                Arc::new(Backend::new(BackendSpec::new(&format!("http://b{i}:1")), 100).unwrap())
            })
            .collect()
    }

    fn balancer(kind: PolicyKind) -> Balancer {
        Balancer::new(PolicySettings {
            kind,
            cache_threshold: 0.5,
            balance_abs: 2,
            balance_rel: 1.5,
            session_load_factor: 1.25,
        })
    }

    async fn pick(
        b: &Balancer,
        candidates: &[Arc<Backend>],
        matches: Vec<u64>,
        total: u64,
    ) -> Decision {
        let hashes = PrefixHashes::from_raw(vec![1; total as usize]);
        let ids_to_matches: Vec<(ServerId, u64)> =
            candidates.iter().map(|c| c.id).zip(matches).collect();
        b.decide(candidates.to_vec(), Some(&hashes), None, |ids| async move {
            let matches = ids
                .iter()
                .map(|id| ids_to_matches.iter().find(|(i, _)| i == id).unwrap().1)
                .collect();
            Ok(QueryOutcome::from_matches(&ids, matches, total))
        })
        .await
    }

    #[tokio::test]
    async fn prefix_load_takes_the_match_unless_low_or_overloaded() {
        let bs = backends(3);
        let b = balancer(PolicyKind::PrefixLoad);
        let d = pick(&b, &bs, vec![0, 8, 2], 10).await;
        assert_eq!(
            (d.order[0].url(), d.reason),
            ("http://b1:1", Reason::CacheHit)
        );
        assert_eq!(d.matched_ratio, Some(0.8));
        let d = pick(&b, &bs, vec![0, 4, 2], 10).await;
        assert_eq!(d.reason, Reason::BelowThreshold);
        // b1 holds the prefix but has 5 more in flight than the least loaded: guard trips.
        bs[1].inflight.store(5, Relaxed);
        let d = pick(&b, &bs, vec![0, 8, 2], 10).await;
        assert_eq!(d.reason, Reason::LoadGuard);
        assert_ne!(d.order[0].url(), "http://b1:1");
        bs[1].inflight.store(2, Relaxed);
        let d = pick(&b, &bs, vec![0, 8, 2], 10).await;
        assert_eq!(
            (d.order[0].url(), d.reason),
            ("http://b1:1", Reason::CacheHit)
        );
        // Every backend appears once in the order.
        assert_eq!(d.order.len(), 3);
    }

    #[tokio::test]
    async fn equal_load_spreads_new_prefixes() {
        let bs = backends(4);
        let b = balancer(PolicyKind::PrefixLoad);
        let mut firsts = std::collections::HashSet::new();
        for _ in 0..4 {
            let d = pick(&b, &bs, vec![0, 0, 0, 0], 10).await;
            firsts.insert(d.order[0].url().to_owned());
        }
        assert_eq!(
            firsts.len(),
            4,
            "four new prefixes on four idle backends go to four backends"
        );
        // Fewer index entries win among equal loads.
        bs[0].entries.store(10, Relaxed);
        bs[1].entries.store(10, Relaxed);
        bs[2].entries.store(0, Relaxed);
        bs[3].entries.store(10, Relaxed);
        let d = pick(&b, &bs, vec![0, 0, 0, 0], 10).await;
        assert_eq!(d.order[0].url(), "http://b2:1");
    }

    #[test]
    fn weights_scale_load() {
        let heavy = weighted("http://big:1", 4);
        let light = weighted("http://small:1", 1);
        heavy.inflight.store(3, Relaxed);
        light.inflight.store(1, Relaxed);
        let mut order = vec![light.clone(), heavy.clone()];
        by_load(&mut order, 0);
        assert_eq!(
            order[0].url(),
            "http://big:1",
            "3 of weight 4 is less load than 1 of weight 1"
        );
    }

    fn weighted(url: &str, weight: u32) -> Arc<Backend> {
        Arc::new(
            Backend::new(
                BackendSpec {
                    weight,
                    ..BackendSpec::new(url)
                },
                100,
            )
            .unwrap(),
        )
    }

    #[tokio::test]
    async fn the_load_guard_compares_load_per_weight() {
        let big = weighted("http://big:1", 4);
        let small = weighted("http://small:1", 1);
        big.inflight.store(40, Relaxed);
        small.inflight.store(10, Relaxed);
        let b = balancer(PolicyKind::PrefixLoad);
        let d = pick(&b, &[small.clone(), big.clone()], vec![0, 9], 10).await;
        assert_eq!(
            (d.order[0].url(), d.reason),
            ("http://big:1", Reason::CacheHit),
            "40 of weight 4 is as loaded as 10 of weight 1"
        );
        big.inflight.store(80, Relaxed);
        let d = pick(&b, &[small, big], vec![0, 9], 10).await;
        assert_eq!(
            d.reason,
            Reason::LoadGuard,
            "80 of weight 4 is twice 10 of weight 1"
        );
    }

    #[tokio::test]
    async fn the_session_bound_scales_with_weight() {
        let none = |_: Vec<ServerId>| async { Err::<QueryOutcome, _>(StoreFailure) };
        let b = balancer(PolicyKind::Session);
        let big = weighted("http://big:1", 4);
        let small = weighted("http://small:1", 1);
        let both = vec![small.clone(), big.clone()];
        // A session key whose rendezvous favourite is `favourite` (on an idle fleet).
        let key_for = |favourite: &Arc<Backend>| {
            (0..100)
                .map(|i| format!("user-{i}"))
                .find(|k| {
                    let d = futures_util::FutureExt::now_or_never(b.decide(
                        both.clone(),
                        None,
                        Some(k),
                        none,
                    ))
                    .unwrap();
                    Arc::ptr_eq(&d.order[0], favourite)
                })
                .unwrap()
        };
        let (big_key, small_key) = (key_for(&big), key_for(&small));
        // 16 in flight at big, 4 at small: big's bound is its 4/5 share of 21 × 1.25 = 21, so
        // it keeps its session (with weights ignored the bound is 14 and the session moved).
        big.inflight.store(16, Relaxed);
        small.inflight.store(4, Relaxed);
        let d = b.decide(both.clone(), None, Some(&big_key), none).await;
        assert_eq!(d.reason, Reason::SessionAffinity);
        assert!(Arc::ptr_eq(&d.order[0], &big));
        // 3 at small, 4 at big: small's bound is its 1/5 share of 8 × 1.25 = 2, so its session
        // overflows (with weights ignored the bound is 5 and it stayed).
        big.inflight.store(4, Relaxed);
        small.inflight.store(3, Relaxed);
        let d = b.decide(both, None, Some(&small_key), none).await;
        assert_eq!(d.reason, Reason::SessionOverflow);
        assert!(Arc::ptr_eq(&d.order[0], &big));
    }

    #[tokio::test]
    async fn store_failure_routes_by_load() {
        let bs = backends(2);
        bs[0].inflight.store(3, Relaxed);
        let b = balancer(PolicyKind::PrefixLoad);
        let hashes = PrefixHashes::from_raw(vec![1, 2]);
        let d = b
            .decide(bs.clone(), Some(&hashes), None, |_| async {
                Err(StoreFailure)
            })
            .await;
        assert_eq!(
            (d.order[0].url(), d.reason),
            ("http://b1:1", Reason::StoreUnavailable)
        );
    }

    #[tokio::test]
    async fn sessions_stick_and_overflow_when_loaded() {
        let bs = backends(4);
        let b = balancer(PolicyKind::Session);
        let none = |_: Vec<ServerId>| async { Err::<QueryOutcome, _>(StoreFailure) };
        let first = b.decide(bs.clone(), None, Some("user-7"), none).await;
        assert_eq!(first.reason, Reason::SessionAffinity);
        for _ in 0..5 {
            let again = b.decide(bs.clone(), None, Some("user-7"), none).await;
            assert!(Arc::ptr_eq(&again.order[0], &first.order[0]));
        }
        first.order[0].inflight.store(10, Relaxed);
        let moved = b.decide(bs.clone(), None, Some("user-7"), none).await;
        assert_eq!(moved.reason, Reason::SessionOverflow);
        assert!(!Arc::ptr_eq(&moved.order[0], &first.order[0]));
        // Different sessions spread.
        first.order[0].inflight.store(0, Relaxed);
        let spread: std::collections::HashSet<_> = (0..40)
            .map(|i| {
                let key = format!("user-{i}");
                futures_util::FutureExt::now_or_never(b.decide(bs.clone(), None, Some(&key), none))
                    .unwrap()
                    .order[0]
                    .id
            })
            .collect();
        assert!(spread.len() >= 3);
    }

    #[tokio::test]
    async fn round_robin_cycles() {
        let bs = backends(3);
        let b = balancer(PolicyKind::RoundRobin);
        let none = |_: Vec<ServerId>| async { Err::<QueryOutcome, _>(StoreFailure) };
        let mut seen = Vec::new();
        for _ in 0..6 {
            seen.push(
                b.decide(bs.clone(), None, None, none).await.order[0]
                    .url()
                    .to_owned(),
            );
        }
        assert_eq!(seen[..3], seen[3..]);
        assert_eq!(
            seen.iter().collect::<std::collections::HashSet<_>>().len(),
            3
        );
    }
}
