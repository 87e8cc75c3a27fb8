//! The decision core: the fleet, the match sources and the policy, without any transport.
//!
//! It answers "where should this request go, and in what order should the others be tried"
//! ([`Core::pick`]) and takes "it was sent there" ([`Core::sent`]); the HTTP gateway (`serve`)
//! and later front ends call it, and turn its outcomes into responses at their edge. It also
//! keeps the fleet's state transitions that touch the index (a backend leaving, failing,
//! coming back) in one place, for the monitor and discovery to call.

pub mod admission;
pub mod backend;
pub mod continued;
pub mod disagg;
pub mod events;
pub mod matches;
pub mod metrics;
pub mod policy;
pub mod prefill;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use prometheus_client::registry::Registry;

use backend::{Backend, BackendSpec, Fleet};
use matches::{MatchSource, PromptKey, StringIndex};
use metrics::{CoreMetrics, DecisionLabels};
use policy::{
    explain, CandidateRow, Choice, MatchFacts, MatchedBy, Policy, PolicySettings, Reason,
    RequestFacts,
};

/// Settings of the core's fleet handling.
#[derive(Clone, Debug)]
pub struct CoreSettings {
    /// Failed checks (or connection failures) before a backend leaves the candidates.
    pub unhealthy_after: u32,
    /// The index capacity of a backend before its KV cache size is known.
    pub default_capacity: u64,
    /// Prefill/decode disaggregation (fleets with `prefill` or `decode` servers).
    pub pd: disagg::PdSettings,
}

/// What a request asks of the core.
#[derive(Clone, Copy, Debug)]
pub struct RequestInput<'a> {
    /// The session key, if the request carries one.
    pub session: Option<&'a str>,
    /// What the string index matches (None: route by load only).
    pub prompt: Option<&'a PromptKey>,
    /// The request string `prompt` was made of (to tell whether it continues a prompt another
    /// replica has in flight).
    pub text: Option<&'a str>,
    /// Its token ids exactly as vLLM computes them, when the router could (precise mode).
    pub tokens: Option<&'a [u32]>,
    /// Let go by the gateway queue under these bounds: see [`admission::where_released_may_go`].
    pub released_under: Option<&'a admission::Bounds>,
}

/// A random number from the OS's randomness (std's randomly keyed hasher): a replica's id,
/// a decision counter's start.
pub fn random_u64() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0u8)
}

/// Keeps the items whose flag is set (`keep` is as long as `items`).
fn retain_where<T>(items: &mut Vec<T>, keep: &[bool]) {
    let mut flags = keep.iter();
    items.retain(|_| flags.next().copied().unwrap_or(true));
}

/// The candidates for a model: the healthy backends serving it.
pub struct Candidates {
    pub backends: Vec<Arc<Backend>>,
    /// Some backend serves the model (healthy or not): its name as they spell it.
    pub model: Option<Arc<str>>,
}

/// Where a request goes.
#[derive(Debug)]
pub struct Decision {
    /// Every candidate once, the chosen one first: the failover order.
    pub order: Vec<Arc<Backend>>,
    pub reason: Reason,
    /// Matched ÷ request tokens of the chosen backend (prefix policies).
    pub matched_ratio: Option<f64>,
    /// Which index answered for the chosen backend: `events`, `strings`, or `none`.
    pub index: &'static str,
    /// The request's token-block names (precise mode), to credit where it is sent.
    pub block_names: Option<events::BlockNames>,
    /// Prompt tokens each backend of `order` would have to compute (what it does not hold),
    /// where the request's matches are known; else empty. Zero for decode servers that pull
    /// the prompt from a prefill server.
    pub uncached: Vec<u64>,
    /// In a disaggregated fleet (`order` then holds the decode servers): whether a prefill
    /// server computes the prompt first, and which ones to try.
    pub pd: Option<disagg::PdOutcome>,
    pub prefill: Option<disagg::PrefillPlan>,
}

/// Where precise matches come from.
#[derive(Clone, Debug)]
pub struct EventsSettings {
    pub events: events::EventSettings,
    /// A backend's publisher when its config names none: its host, this port.
    pub default_port: u16,
    /// A backend's replay socket when its config names none: its host, this port (none:
    /// gaps are not filled in).
    pub replay_port: Option<u16>,
}

/// Called with a backend that left the fleet.
type BackendListener = Box<dyn Fn(&Backend) + Send + Sync>;

/// Hears what this router does and sees that other replicas should know (the replica bus
/// tells them). Called on the request path and from health checks: it must not wait.
pub trait LocalEvents: Send + Sync {
    /// A request was sent to `backend` (with what the indexes match of it, if anything: its
    /// string-index key, and its block names under the backend's block size).
    fn sent(
        &self,
        prompt: Option<&PromptKey>,
        blocks: Option<(u32, &Arc<[u64]>)>,
        backend: &Backend,
    );
    /// `backend` just left the candidates (failed checks or connections).
    fn backend_unhealthy(&self, backend: &Backend);
    /// A streamed request's first byte came from `backend` (its line learned from it).
    fn first_byte(&self, backend: &Backend, seen: prefill::FirstByte);
    /// A request whose chain's last hash is `last` ended at `backend`.
    fn ended(&self, last: u64, backend: &Backend);
}

/// `backend`'s prefill line learns from one first byte; the prediction it is judged against
/// is the cost policy's, recomputed through the line as it is now.
fn learn_first_byte(backend: &Backend, seen: prefill::FirstByte) {
    backend
        .prefill
        .learn(seen.work, seen.ttft_s, seen.under_way_s, |line| {
            let row = CandidateRow {
                prefill: line,
                stalled_secs: seen.under_way_s,
                kv_usage: seen.kv_usage,
                ..CandidateRow::default()
            };
            policy::ttft_after_queue(&row, seen.work, seen.uncached)
        });
}

/// The decision core.
pub struct Core {
    pub fleet: Fleet,
    pub strings: Arc<StringIndex>,
    /// The backends' KV events (`--kv-events`), if followed.
    pub events: Option<Arc<events::KvEvents>>,
    events_ports: (u16, Option<u16>),
    policy: Box<dyn Policy>,
    least_loaded: policy::LeastLoaded,
    /// Counts decisions; policies draw near-ties and take turns by it. It starts at a random
    /// value: replicas behind one load balancer get requests in lock-step, so counters that all
    /// started at 0 would make replicas with the same view pick alike (a burst fanned out over
    /// them would land on one backend).
    turn: AtomicU64,
    /// This router's rank among the live router replicas (0 without peers), kept by the
    /// replica bus: see [`RequestFacts::replica_rank`].
    replica_rank: AtomicU32,
    settings: CoreSettings,
    metrics: CoreMetrics,
    /// Drops of backends' index entries still running, by server id: a backend that comes
    /// back (healthy again, or re-added) waits for its drop before its capacity is set again.
    pending_drops: parking_lot::Mutex<HashMap<prefix_index::ServerId, tokio::task::JoinHandle<()>>>,
    /// Told when a backend leaves the fleet (its metric series go, for one).
    on_left: parking_lot::Mutex<Vec<BackendListener>>,
    /// Told of every request sent and backend lost (the replica bus, when there is one).
    on_local: std::sync::OnceLock<Box<dyn LocalEvents>>,
    /// The prompts other replicas have in flight (the replica bus keeps it).
    elsewhere: arc_swap::ArcSwap<continued::PromptsElsewhere>,
}

impl Core {
    /// A core with an empty fleet, registering its metrics in `registry`.
    pub fn new(
        strings: StringIndex,
        events: Option<EventsSettings>,
        policy: &PolicySettings,
        settings: CoreSettings,
        registry: &mut Registry,
    ) -> Self {
        Self {
            fleet: Fleet::default(),
            strings: Arc::new(strings),
            events_ports: events
                .as_ref()
                .map_or((0, None), |e| (e.default_port, e.replay_port)),
            events: events.map(|e| events::KvEvents::new(e.events, registry)),
            policy: policy::build(policy),
            least_loaded: policy::LeastLoaded,
            turn: AtomicU64::new(random_u64()),
            replica_rank: AtomicU32::new(0),
            settings,
            metrics: CoreMetrics::register(registry),
            pending_drops: Default::default(),
            on_left: Default::default(),
            on_local: Default::default(),
            elsewhere: Default::default(),
        }
    }

    /// The configured policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Whether the policy matches prefixes (so the caller hashes the request string).
    pub fn uses_prefixes(&self) -> bool {
        self.policy.needs_matches()
    }

    /// The prefix store behind the string index.
    pub fn store(&self) -> &Arc<dyn prefix_index::PrefixStore> {
        &self.strings.store
    }

    /// Tells `listener` of every request sent and backend lost from now on (one listener:
    /// false if one is set).
    pub fn on_local_events(&self, listener: Box<dyn LocalEvents>) -> bool {
        self.on_local.set(listener).is_ok()
    }

    /// The backend with this server id, if it is in the fleet.
    pub fn backend(&self, id: prefix_index::ServerId) -> Option<Arc<Backend>> {
        self.fleet.by_id(id)
    }

    /// Another router replica sent a request to `backend` at `t`: the string index (and in
    /// precise mode the backend's block credits) learn it as if this router had sent it.
    pub fn peer_sent(
        &self,
        chunks: &prefix_index::PrefixHashes,
        blocks: Option<(Option<u32>, Arc<[u64]>)>,
        backend: &Arc<Backend>,
        t: prefix_index::Tick,
    ) {
        if !chunks.is_empty() && self.policy.needs_matches() {
            self.strings.notify_from_peer(chunks, backend, t);
        }
        if let (Some(events), Some((size, names))) = (&self.events, blocks) {
            // Replicas before block sizes were told named blocks under the backend's own.
            if let Some(size) = size.or_else(|| events.block_size(backend.id)) {
                events.credit_sized(backend.id, size, names);
            }
        }
    }

    /// A streamed request's first byte came from `backend`: its prefill line learns from it,
    /// and the other replicas are told.
    pub fn first_byte(&self, backend: &Backend, seen: prefill::FirstByte) {
        learn_first_byte(backend, seen);
        if let Some(listener) = self.on_local.get() {
            listener.first_byte(backend, seen);
        }
    }

    /// Whether requests' ends are told to another replica (then [`Self::ended`] is worth calling).
    pub fn tells_ends(&self) -> bool {
        self.on_local.get().is_some() && self.policy.needs_matches()
    }

    /// A request whose chain's last hash is `last` ended at `backend`.
    pub fn ended(&self, last: u64, backend: &Backend) {
        if let Some(listener) = self.on_local.get() {
            listener.ended(last, backend);
        }
    }

    /// Another router replica saw a first byte from `backend`: its line learns from it as if
    /// this router had (through four replicas each would otherwise learn from a quarter of the
    /// answers: on real vLLM the predictions' median error doubled).
    pub fn peer_first_byte(&self, backend: &Backend, seen: prefill::FirstByte) {
        learn_first_byte(backend, seen);
    }

    /// This router is `rank` (0-based) of the live router replicas, ranked alike by all of
    /// them (by their bus ids).
    pub fn set_replica_rank(&self, rank: u32) {
        self.replica_rank.store(rank, Relaxed);
    }

    /// The prompts the other replicas have in flight now.
    pub fn set_prompts_elsewhere(&self, prompts: continued::PromptsElsewhere) {
        self.elsewhere.store(Arc::new(prompts));
    }

    /// A request that continues a prompt another replica has in flight at a candidate: that
    /// request has ended (the client read its answer), so it no longer counts in that
    /// backend's load here.
    fn count_continued_as_ended(
        &self,
        prompt: &PromptKey,
        text: &str,
        candidates: &[Arc<Backend>],
        rows: &mut [CandidateRow],
    ) {
        let elsewhere = self.elsewhere.load();
        let chain = prompt.chunks.as_slice();
        for id in elsewhere.continued(&self.strings.hasher, chain, text.as_bytes()) {
            let Some(i) = candidates.iter().position(|b| b.id == id) else {
                continue;
            };
            if candidates[i].remote.inflight.load(Relaxed) > 0 && rows[i].inflight > 0 {
                rows[i].inflight -= 1;
                self.metrics.continued_elsewhere.inc();
            }
        }
    }

    /// Calls `f` with every backend that leaves the fleet.
    pub fn on_backend_left(&self, f: impl Fn(&Backend) + Send + Sync + 'static) {
        self.on_left.lock().push(Box::new(f));
    }

    /// The healthy backends serving `model` (every backend when the request names none).
    pub fn candidates(&self, model: Option<&str>) -> Candidates {
        let fleet = self.fleet.snapshot();
        let mut out = Candidates {
            backends: Vec::with_capacity(fleet.len()),
            model: None,
        };
        for b in fleet.iter() {
            let serves = match model {
                Some(m) => b.serves(m),
                None => Some(Arc::from("")),
            };
            if let Some(name) = serves {
                out.model.get_or_insert(name);
                if b.is_healthy() {
                    out.backends.push(b.clone());
                }
            }
        }
        out
    }

    /// How many healthy backends serving `model` have room under `bounds` (the gateway queue
    /// holds its requests while none has). With none healthy, one: the request is refused at
    /// once instead of queued.
    pub fn room(&self, model: Option<&str>, bounds: &admission::Bounds) -> usize {
        let candidates = self.candidates(model).backends;
        if candidates.is_empty() {
            return 1;
        }
        candidates
            .iter()
            .filter(|b| !admission::saturated(&b.row(), bounds))
            .count()
    }

    /// Orders `candidates` (not empty) for a request by the configured policy, asking the
    /// match sources first when the policy uses matches: the token-block index for backends
    /// whose events are live, the string index for the others (both answer in tokens).
    pub async fn pick(
        &self,
        mut candidates: Vec<Arc<Backend>>,
        input: RequestInput<'_>,
    ) -> Decision {
        let mut rows: Vec<CandidateRow> = candidates.iter().map(|b| b.row()).collect();
        if let (Some(key), Some(text)) = (input.prompt, input.text) {
            self.count_continued_as_ended(key, text, &candidates, &mut rows);
        }
        let mut matches = MatchFacts::None;
        let mut block_names = None;
        if self.policy.needs_matches() {
            let precise = match (&self.events, input.tokens) {
                (Some(events), Some(tokens)) => {
                    let (held, names) = events.matches(tokens, &candidates);
                    (!names.is_empty()).then_some((names, held))
                }
                _ => None,
            };
            let need_strings = precise
                .as_ref()
                .is_none_or(|(_, held)| held.iter().any(Option::is_none));
            let strings = match input.prompt {
                Some(key) if need_strings && !key.chunks.is_empty() => {
                    Some(self.strings.matches(key, &candidates).await)
                }
                _ => None,
            };
            let total = input.tokens.map(|t| t.len() as u64).or(match &strings {
                Some(Ok(m)) => Some(m.total_tokens),
                _ => None,
            });
            for (i, row) in rows.iter_mut().enumerate() {
                if let Some(held) = precise.as_ref().and_then(|(_, h)| h[i]) {
                    row.matched_tokens = held;
                    row.matched_by = MatchedBy::Events;
                } else if let Some(Ok(m)) = &strings {
                    row.matched_tokens = m.held_tokens[i];
                    row.matched_by = MatchedBy::Strings;
                }
            }
            let any_source = rows.iter().any(|r| r.matched_by != MatchedBy::None);
            matches = match (total, strings.as_ref()) {
                (Some(total_tokens), _) if any_source || total_tokens == 0 => {
                    MatchFacts::Known { total_tokens }
                }
                (_, Some(Err(matches::Unavailable))) => MatchFacts::Unavailable,
                _ => MatchFacts::None,
            };
            block_names = precise.map(|(names, _)| names);
        }
        if let Some(keep) = input
            .released_under
            .and_then(|bounds| admission::where_released_may_go(&rows, bounds))
        {
            retain_where(&mut candidates, &keep);
            retain_where(&mut rows, &keep);
        }
        let facts = RequestFacts {
            session: input.session,
            matches,
            turn: self.turn.fetch_add(1, Relaxed),
            replica_rank: self.replica_rank.load(Relaxed),
        };
        let disaggregated = candidates.iter().any(|b| b.role() != disagg::Role::Both);
        let mut decision = if disaggregated {
            self.decide_disaggregated(&*self.policy, candidates, rows, &facts)
        } else {
            self.decide(&*self.policy, candidates, &rows, &facts)
        };
        decision.block_names = block_names;
        decision
    }

    /// Orders `candidates` (not empty) by load alone (endpoints with nothing to match).
    pub fn pick_by_load(&self, candidates: Vec<Arc<Backend>>) -> Decision {
        let rows: Vec<CandidateRow> = candidates.iter().map(|b| b.row()).collect();
        let facts = RequestFacts {
            session: None,
            matches: MatchFacts::None,
            turn: self.turn.fetch_add(1, Relaxed),
            replica_rank: self.replica_rank.load(Relaxed),
        };
        self.decide(&self.least_loaded, candidates, &rows, &facts)
    }

    fn decide(
        &self,
        policy: &dyn Policy,
        candidates: Vec<Arc<Backend>>,
        rows: &[CandidateRow],
        facts: &RequestFacts,
    ) -> Decision {
        let choice = policy.choose(rows, facts);
        let reason = choice.reason.label();
        self.settle(policy, candidates, rows, facts, choice, reason)
    }

    /// A disaggregated fleet: the decode server by `policy` among the servers that decode,
    /// then whether and where the prompt is prefilled ([`disagg`]). Counted under the P/D
    /// outcome's reason (the decode choice's own is in the decision log).
    fn decide_disaggregated(
        &self,
        policy: &dyn Policy,
        candidates: Vec<Arc<Backend>>,
        rows: Vec<CandidateRow>,
        facts: &RequestFacts,
    ) -> Decision {
        let roles: Vec<disagg::Role> = candidates.iter().map(|b| b.role()).collect();
        let decodes: Vec<bool> = roles.iter().map(|r| r.decodes()).collect();
        if !decodes.contains(&true) {
            // Only prefill servers are healthy: they answer whole requests (vLLM servers all
            // can), rather than nobody.
            return self.decide(policy, candidates, &rows, facts);
        }
        let (mut decode_candidates, mut decode_rows) = (candidates.clone(), rows.clone());
        retain_where(&mut decode_candidates, &decodes);
        retain_where(&mut decode_rows, &decodes);
        let choice = policy.choose(&decode_rows, facts);
        let decode = &decode_candidates[choice.order[0]];
        let prefills: Vec<bool> = candidates
            .iter()
            .zip(&roles)
            .map(|(b, r)| r.prefills() && b.id != decode.id)
            .collect();
        let (mut prefill_candidates, mut prefill_rows) = (candidates, rows);
        retain_where(&mut prefill_candidates, &prefills);
        retain_where(&mut prefill_rows, &prefills);
        let (outcome, prefill) = disagg::plan_prefill(
            policy,
            self.settings.pd,
            &decode_rows[choice.order[0]],
            (&prefill_candidates, &prefill_rows),
            facts,
        );
        let mut decision = self.settle(
            policy,
            decode_candidates,
            &decode_rows,
            facts,
            choice,
            outcome.label(),
        );
        if prefill.is_some() {
            // A decode server that pulls the prompt computes none of it.
            decision.uncached = vec![0; decision.order.len()];
        }
        decision.pd = Some(outcome);
        decision.prefill = prefill;
        decision
    }

    /// A decision from `choice`, counted under `reason`.
    fn settle(
        &self,
        policy: &dyn Policy,
        candidates: Vec<Arc<Backend>>,
        rows: &[CandidateRow],
        facts: &RequestFacts,
        choice: Choice,
        reason: &'static str,
    ) -> Decision {
        debug_assert_eq!(choice.order.len(), candidates.len());
        if tracing::enabled!(target: "prefix_router::decision", tracing::Level::DEBUG) {
            explain(policy, rows, facts, &choice);
        }
        let index = rows[choice.order[0]].matched_by.label();
        self.metrics
            .decisions
            .get_or_create(&DecisionLabels {
                policy: policy.name(),
                reason,
                index,
            })
            .inc();
        if let Some(ratio) = choice.matched_ratio {
            self.metrics.matched_ratio.observe(ratio);
        }
        let uncached = match facts.matches {
            MatchFacts::Known { total_tokens } => choice
                .order
                .iter()
                .map(|&p| total_tokens.saturating_sub(rows[p].matched_tokens))
                .collect(),
            _ => Vec::new(),
        };
        Decision {
            uncached,
            order: choice
                .order
                .iter()
                .map(|&p| candidates[p].clone())
                .collect(),
            reason: choice.reason,
            matched_ratio: choice.matched_ratio,
            index,
            block_names: None,
            pd: None,
            prefill: None,
        }
    }

    /// The request was sent to `backend`: the string index learns it (it answers for backends
    /// without live events, and for all of them should the events fail), and the chosen
    /// backend is credited with the request's blocks.
    pub async fn sent(
        &self,
        prompt: Option<&PromptKey>,
        block_names: Option<&events::BlockNames>,
        backend: &Arc<Backend>,
    ) {
        if let Some(key) = prompt.filter(|_| self.policy.needs_matches()) {
            self.strings.sent(key, backend).await;
        }
        let mut blocks = None;
        if let (Some(events), Some(names)) = (&self.events, block_names) {
            events.credit(backend.id, names);
            blocks = events
                .block_size(backend.id)
                .and_then(|size| Some((size, names.sized(size)?)));
        }
        if let Some(listener) = self.on_local.get() {
            let prompt = prompt.filter(|_| self.policy.needs_matches());
            listener.sent(prompt, blocks, backend);
        }
    }

    /// Refreshes the fleet's gauges before a scrape.
    pub fn observe_fleet(&self) {
        self.metrics.observe_fleet(&self.fleet.all());
        if let Some(events) = &self.events {
            events.observe();
        }
    }

    /// The KV-event publisher of a backend and its replay socket: the configured ones, else
    /// its host and the default ports.
    fn events_endpoints(&self, backend: &Backend) -> Option<events::FeedEndpoints> {
        let spec = backend.spec();
        let host = backend.base.host();
        let (events_port, replay_port) = self.events_ports;
        let events = match &spec.kv_events {
            Some(endpoint) => endpoint.clone(),
            None => format!("tcp://{}:{events_port}", host?),
        };
        let replay = spec.kv_replay.clone().or_else(|| {
            let port = replay_port?;
            Some(format!("tcp://{}:{port}", host?))
        });
        Some(events::FeedEndpoints { events, replay })
    }

    /// A health check or a connection failed; after `--unhealthy-after` the backend leaves the
    /// candidates, and its index entries go (a restarted vLLM has an empty cache).
    pub fn backend_failed(&self, backend: &Arc<Backend>) {
        if backend.record_failure(self.settings.unhealthy_after) {
            tracing::warn!(
                backend = backend.url(),
                "backend is unhealthy: it leaves the candidates"
            );
            self.forget(backend.clone());
            if let Some(events) = &self.events {
                events.forget(backend.id);
            }
            if let Some(listener) = self.on_local.get() {
                listener.backend_unhealthy(backend);
            }
        }
    }

    /// A check succeeded: a backend that was unhealthy is a candidate again, and its index
    /// capacity (dropped with its entries) is set again once the drop has finished.
    pub async fn backend_succeeded(&self, backend: &Arc<Backend>) {
        if backend.record_success() {
            tracing::info!(backend = backend.url(), "backend is healthy");
            self.restore_capacity(backend).await;
        }
    }

    /// Sets the backend's index capacity to `capacity` chunks (derived from its KV cache).
    pub async fn set_capacity(&self, backend: &Backend, capacity: u64) {
        match self.strings.store.set_capacity(backend.id, capacity).await {
            Ok(evicted) => tracing::info!(
                backend = backend.url(),
                capacity,
                evicted,
                bytes_per_token = backend.bytes_per_token(),
                "index capacity from the backend's KV cache size"
            ),
            Err(e) => {
                tracing::warn!(backend = backend.url(), error = %e, "could not set the index capacity")
            }
        }
    }

    /// Drops a backend's index entries (it left, or it failed and may come back empty). The
    /// drop runs in the background; [`Core::restore_capacity`] waits for it.
    fn forget(&self, backend: Arc<Backend>) {
        let strings = self.strings.clone();
        let id = backend.id;
        backend.entries.store(0, Relaxed);
        let mut pending = self.pending_drops.lock();
        let before = pending.remove(&id);
        let drop = tokio::spawn(async move {
            if let Some(before) = before {
                let _ = before.await;
            }
            if let Err(e) = strings.store.drop_server(backend.id).await {
                tracing::warn!(backend = backend.url(), error = %e, "could not drop the backend's index entries");
            }
        });
        pending.insert(id, drop);
    }

    /// Waits for a pending drop of the backend's entries, then sets its index capacity (the
    /// configured one or the one derived from its KV cache): a store forgets a server's
    /// capacity with its entries.
    async fn restore_capacity(&self, backend: &Backend) {
        let pending = self.pending_drops.lock().remove(&backend.id);
        if let Some(drop) = pending {
            let _ = drop.await;
        }
        let capacity = backend.capacity.load(Relaxed);
        if capacity != self.settings.default_capacity || backend.spec().capacity.is_some() {
            if let Err(e) = self.strings.store.set_capacity(backend.id, capacity).await {
                tracing::warn!(backend = backend.url(), error = %e, "could not set the index capacity");
            }
        }
    }

    /// Makes the fleet `specs`: new backends join (their capacity set), gone ones leave (their
    /// entries dropped), changed ones are updated in place. Returns the backends that joined,
    /// for the caller to check at once.
    pub async fn set_backends(&self, specs: &[BackendSpec]) -> anyhow::Result<Vec<Arc<Backend>>> {
        let change = self
            .fleet
            .reconcile(specs, self.settings.default_capacity)?;
        // The feeds follow the fleet before anything is awaited: a caller aborted at an await
        // below (a pod watch restarted for a changed pool) must not leave them stale.
        if let Some(events) = &self.events {
            events.sync(&self.fleet.all(), |b| self.events_endpoints(b));
        }
        for gone in change.removed {
            tracing::info!(backend = gone.url(), "backend left");
            for f in self.on_left.lock().iter() {
                f(&gone);
            }
            self.forget(gone);
        }
        for b in &change.updated {
            tracing::info!(backend = b.url(), "backend settings changed");
            if b.spec().capacity.is_some() {
                self.restore_capacity(b).await;
            }
        }
        for b in &change.added {
            tracing::info!(backend = b.url(), "backend joined");
            self.restore_capacity(b).await;
        }
        Ok(change.added)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::Duration;

    use prefix_index::{MemoryStore, PrefixHasher, StoreConfig};

    use super::*;
    use policy::PolicyKind;

    /// A router replica with its own memory index and `--policy cost`.
    fn replica() -> Core {
        let store = Arc::new(MemoryStore::new(StoreConfig::default()).unwrap());
        let mut registry = Registry::default();
        let strings = StringIndex::new(
            store,
            PrefixHasher::default(),
            Duration::from_secs(1),
            true,
            &mut registry,
        );
        let policy = PolicySettings {
            kind: PolicyKind::Cost,
            cache_threshold: 0.5,
            balance_abs: 16,
            balance_rel: 1.5,
            session_load_factor: 1.25,
        };
        let settings = CoreSettings {
            pd: disagg::PdSettings { threshold: 512 },
            unhealthy_after: 1,
            default_capacity: 1000,
        };
        Core::new(strings, None, &policy, settings, &mut registry)
    }

    fn backend(url: &str) -> Backend {
        Backend::new(BackendSpec::new(url), 1000).unwrap()
    }

    /// A request for `text`, matched by `key`, without session or tokens.
    fn prompt_input<'a>(key: &'a PromptKey, text: &'a str) -> RequestInput<'a> {
        RequestInput {
            session: None,
            prompt: Some(key),
            text: Some(text),
            tokens: None,
            released_under: None,
        }
    }

    /// Replicas behind one load balancer see the same fleet and get their requests in
    /// lock-step; a burst fanned out over them (one request each, at the same moment) must not
    /// all land on the backend one shared count names — whether no backend holds the prompt
    /// (taken by load, in turn among equals) or both do (a near-tie, drawn).
    #[tokio::test]
    async fn replicas_with_the_same_view_do_not_all_pick_alike() {
        let fleet: Vec<Arc<Backend>> = ["http://a:1", "http://b:1"]
            .iter()
            .map(|url| Arc::new(backend(url)))
            .collect();
        let prompt = "the same system prompt for every sibling; ".repeat(100);
        let (mut new_prompt, mut held_by_both) = (HashSet::new(), HashSet::new());
        for _ in 0..32 {
            let core = replica();
            let key = core.strings.key(&prompt);
            let input = prompt_input(&key, &prompt);
            let first = core.pick(fleet.clone(), input).await;
            new_prompt.insert(first.order[0].url().to_owned());
            for b in &fleet {
                core.strings.sent(&key, b).await;
            }
            let again = core.pick(fleet.clone(), input).await;
            assert_eq!(again.matched_ratio, Some(1.0), "both hold it");
            held_by_both.insert(again.order[0].url().to_owned());
        }
        // Each set has both backends unless 32 replicas drew alike: 2 in 4 billion.
        assert_eq!(new_prompt.len(), 2, "a prompt no backend holds");
        assert_eq!(held_by_both.len(), 2, "a prompt both backends hold");
    }

    /// A burst's siblings fanned out over four replicas at one moment: each sees the same
    /// idle fleet, whose backends hold different numbers of index entries, so the load order
    /// names one least loaded backend whatever their turns; ranked, they place the new prompt
    /// on four backends.
    #[tokio::test]
    async fn ranked_replicas_place_a_burst_on_different_backends() {
        let fleet: Vec<Arc<Backend>> = (0..8)
            .map(|i| {
                let backend = backend(&format!("http://b{i}:1"));
                backend.entries.store(100 + 10 * i, Relaxed);
                Arc::new(backend)
            })
            .collect();
        let prompt = "a burst's new system prompt; ".repeat(100);
        let burst = |ranked: bool| {
            let (fleet, prompt) = (fleet.clone(), prompt.clone());
            async move {
                let mut chosen = HashSet::new();
                for rank in 0..4 {
                    let core = replica();
                    if ranked {
                        core.set_replica_rank(rank);
                    }
                    let key = core.strings.key(&prompt);
                    let decision = core.pick(fleet.clone(), prompt_input(&key, &prompt)).await;
                    chosen.insert(decision.order[0].url().to_owned());
                }
                chosen
            }
        };
        let least_loaded =
            |n: usize| -> HashSet<String> { (0..n).map(|i| format!("http://b{i}:1")).collect() };
        assert_eq!(
            burst(false).await,
            least_loaded(1),
            "unranked, the four picked alike"
        );
        assert_eq!(burst(true).await, least_loaded(4));
    }
}
