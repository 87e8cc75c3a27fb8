//! The backends (vLLM servers) the router knows, and their live state.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::http::{HeaderValue, Uri};
use prefix_index::ServerId;

/// How a backend is configured (flags, config file or discovery).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendSpec {
    /// Base URL, e.g. `http://10.0.0.5:8000` (no trailing slash).
    pub url: String,
    /// Models it serves; `None` to discover them from its `GET /v1/models`.
    pub models: Option<Vec<String>>,
    /// Index capacity in chunks; `None` to derive it from its KV cache size.
    pub capacity: Option<u64>,
    /// Relative capacity: load is compared per unit of weight (1 by default).
    pub weight: u32,
    /// Bearer token sent to this backend.
    pub api_key: Option<String>,
    /// Its KV-event publisher, e.g. `tcp://10.0.0.5:5557` (default: its host and
    /// `--kv-events-port`).
    pub kv_events: Option<String>,
    /// Its publisher's replay socket, e.g. `tcp://10.0.0.5:5558` (default: its host and
    /// `--kv-replay-port`, if set; vLLM opens one only with a `replay_endpoint`).
    pub kv_replay: Option<String>,
    /// What it does in a disaggregated fleet.
    pub role: crate::core::disagg::Role,
}

impl BackendSpec {
    pub fn new(url: &str) -> Self {
        Self {
            url: normalize_url(url),
            models: None,
            capacity: None,
            weight: 1,
            api_key: None,
            kv_events: None,
            kv_replay: None,
            role: Default::default(),
        }
    }
}

/// Lower-cases scheme and host and drops trailing slashes, so one server has one URL.
pub fn normalize_url(url: &str) -> String {
    let url = url.trim().trim_end_matches('/');
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            format!(
                "{}://{}{}",
                scheme.to_ascii_lowercase(),
                authority.to_ascii_lowercase(),
                path
            )
        }
        None => format!("http://{}", url.to_ascii_lowercase()),
    }
}

/// The stable server id of a backend: a hash of its normalized URL, so that router replicas
/// sharing one store agree without coordination.
pub fn server_id(url: &str) -> ServerId {
    xxhash_rust::xxh3::xxh3_64(normalize_url(url).as_bytes())
}

/// A backend and what the router knows of it now.
///
/// One `Backend` lives as long as its URL is configured: a change of its settings (weight,
/// models, capacity, key) updates it in place, so the live state — in-flight counts held by
/// running requests, health, discovered models — carries over.
pub struct Backend {
    /// The URL as a shared label value (also what [`Backend::url`] returns).
    pub label: Arc<str>,
    pub id: ServerId,
    pub base: Uri,
    spec: ArcSwap<BackendSpec>,
    authorization: ArcSwap<Option<HeaderValue>>,
    weight: AtomicU32,
    /// Models served (static, or last discovered).
    pub models: ArcSwap<Vec<Arc<str>>>,
    healthy: AtomicBool,
    failures: AtomicU32,
    /// Requests this router has sent and not yet seen finish.
    pub inflight: AtomicU64,
    /// Of those, the ones whose first byte has not come back yet.
    pub waiting_first_byte: AtomicU64,
    /// Uncached prompt tokens of those: the prefill work queued there by this router.
    pub queued_prefill_tokens: AtomicU64,
    /// When its prefill queue last moved ([`progress_clock`] ns): a first byte came (or a
    /// request left without one), or a request was sent while none of ours was waiting.
    progress_at: AtomicU64,
    /// What the other router replicas hold here, as they last told over the replica bus.
    pub remote: RemoteLoad,
    /// Its prefill speed, learned from the TTFTs of streamed requests.
    pub prefill: crate::core::prefill::PrefillModel,
    /// The longest prompt it takes (`max_model_len` of its models; 0: not known): no request
    /// asks it to prefill more.
    pub max_model_len: AtomicU64,
    /// From the backend's `/metrics`: `vllm:num_requests_running` + `num_requests_waiting`.
    pub reported_queue: AtomicU64,
    pub reported_running: AtomicU64,
    pub reported_waiting: AtomicU64,
    /// This router's (and its replicas') requests without a first byte here when
    /// `reported_waiting` was read: what of the backend's queue was ours then.
    pub waiting_first_byte_at_report: AtomicU64,
    /// `vllm:kv_cache_usage_perc` as f64 bits.
    pub kv_usage_bits: AtomicU64,
    /// Prompt tokens of this router's requests in flight there that it had to compute: KV
    /// blocks they hold until they end (their shared prefixes already held are not counted).
    kv_tokens: AtomicU64,
    /// `kv_tokens` when `kv_usage_bits` was read: what of the reported usage was ours then.
    kv_tokens_at_report: AtomicU64,
    /// Index entries held for this backend, as this router's notifies count them.
    pub entries: AtomicU64,
    /// Index capacity in chunks (configured, or derived from the backend's KV cache).
    pub capacity: AtomicU64,
    /// Requests routed here (for the requests-per-second gauge).
    pub routed: AtomicU64,
    /// Requests per second over the last metrics interval, as f64 bits.
    pub qps_bits: AtomicU64,
    /// Request-string bytes and the prompt tokens the backend reported for them (its answers'
    /// `usage`), halved now and then so recent requests weigh more: their ratio sizes the
    /// index to the backend's real cache.
    usage_bytes: AtomicU64,
    usage_tokens: AtomicU64,
    /// The KV cache in tokens (`num_gpu_blocks × block_size` from its metrics), once known.
    pub cache_tokens: AtomicU64,
}

/// Bytes of request string per token assumed before a backend's answers tell.
pub const DEFAULT_BYTES_PER_TOKEN: f64 = 4.0;
/// Prompt tokens observed before the learned ratio is trusted.
const MIN_USAGE_TOKENS: u64 = 2_000;
/// Above this many observed tokens both sums are halved (a moving window of sorts).
const USAGE_WINDOW_TOKENS: u64 = 2_000_000;

fn authorization(spec: &BackendSpec) -> anyhow::Result<Option<HeaderValue>> {
    spec.api_key
        .as_ref()
        .map(|k| HeaderValue::from_str(&format!("Bearer {k}")))
        .transpose()
        .map_err(|_| anyhow::anyhow!("backend {:?}: the API key is not a valid header", spec.url))
}

fn configured_models(spec: &BackendSpec) -> Vec<Arc<str>> {
    spec.models
        .iter()
        .flatten()
        .map(|m| Arc::from(m.as_str()))
        .collect()
}

impl Backend {
    pub fn new(spec: BackendSpec, default_capacity: u64) -> anyhow::Result<Self> {
        let base: Uri = spec
            .url
            .parse()
            .map_err(|e| anyhow::anyhow!("invalid backend URL {:?}: {e}", spec.url))?;
        anyhow::ensure!(
            base.scheme_str() == Some("http"),
            "backend {:?}: only http:// backends are supported",
            spec.url
        );
        Ok(Self {
            id: server_id(&spec.url),
            capacity: AtomicU64::new(spec.capacity.unwrap_or(default_capacity)),
            base,
            authorization: ArcSwap::from_pointee(authorization(&spec)?),
            weight: AtomicU32::new(spec.weight.max(1)),
            models: ArcSwap::from_pointee(configured_models(&spec)),
            // With configured models, optimistic until the first health check says otherwise.
            // Models still to be discovered: not a candidate (nor counted healthy) before the
            // first check has read them, or a request arriving meanwhile would find no backend
            // for its model.
            healthy: AtomicBool::new(spec.models.is_some()),
            failures: AtomicU32::new(0),
            inflight: AtomicU64::new(0),
            waiting_first_byte: AtomicU64::new(0),
            queued_prefill_tokens: AtomicU64::new(0),
            progress_at: AtomicU64::new(progress_clock()),
            remote: RemoteLoad::default(),
            prefill: Default::default(),
            max_model_len: AtomicU64::new(0),
            reported_queue: AtomicU64::new(0),
            reported_running: AtomicU64::new(0),
            reported_waiting: AtomicU64::new(0),
            waiting_first_byte_at_report: AtomicU64::new(0),
            kv_usage_bits: AtomicU64::new(0),
            kv_tokens: AtomicU64::new(0),
            kv_tokens_at_report: AtomicU64::new(0),
            entries: AtomicU64::new(0),
            routed: AtomicU64::new(0),
            qps_bits: AtomicU64::new(0),
            usage_bytes: AtomicU64::new(0),
            usage_tokens: AtomicU64::new(0),
            cache_tokens: AtomicU64::new(0),
            label: spec.url.as_str().into(),
            spec: ArcSwap::from_pointee(spec),
        })
    }

    /// Applies changed settings of the same URL, keeping the live state. Configured models
    /// replace the known ones at once; a configured capacity is the caller's to send to the
    /// store.
    pub fn update(&self, spec: BackendSpec) -> anyhow::Result<()> {
        debug_assert_eq!(spec.url, *self.label);
        self.authorization.store(Arc::new(authorization(&spec)?));
        self.weight.store(spec.weight.max(1), Relaxed);
        if spec.models.is_some() {
            self.models.store(Arc::new(configured_models(&spec)));
        }
        if let Some(capacity) = spec.capacity {
            self.capacity.store(capacity, Relaxed);
        }
        self.spec.store(Arc::new(spec));
        Ok(())
    }

    /// The settings now.
    pub fn spec(&self) -> Arc<BackendSpec> {
        self.spec.load_full()
    }

    /// What it does in a disaggregated fleet.
    pub fn role(&self) -> crate::core::disagg::Role {
        self.spec.load().role
    }

    /// Relative capacity (at least 1): load is compared per unit of weight.
    pub fn weight(&self) -> u64 {
        u64::from(self.weight.load(Relaxed))
    }

    /// `Authorization` to send upstream, if a key is configured.
    pub fn authorization(&self) -> Option<HeaderValue> {
        self.authorization.load().as_ref().clone()
    }

    pub fn url(&self) -> &str {
        &self.label
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Relaxed)
    }

    /// The backend's name for `model` if it serves it (a shared string, for metric labels).
    pub fn serves(&self, model: &str) -> Option<Arc<str>> {
        self.models.load().iter().find(|m| &***m == model).cloned()
    }

    pub fn qps(&self) -> f64 {
        f64::from_bits(self.qps_bits.load(Relaxed))
    }

    /// Records a failed check or request; returns true when it made the backend unhealthy.
    pub fn record_failure(&self, unhealthy_after: u32) -> bool {
        let failures = self.failures.fetch_add(1, Relaxed) + 1;
        failures >= unhealthy_after && self.healthy.swap(false, Relaxed)
    }

    /// Records a successful check; returns true when it made the backend healthy again.
    pub fn record_success(&self) -> bool {
        self.failures.store(0, Relaxed);
        !self.healthy.swap(true, Relaxed)
    }

    /// A request string of `bytes` bytes came to `tokens` prompt tokens here.
    pub fn observe_prompt(&self, bytes: u64, tokens: u64) {
        if bytes == 0 || tokens == 0 {
            return;
        }
        self.usage_bytes.fetch_add(bytes, Relaxed);
        let total = self.usage_tokens.fetch_add(tokens, Relaxed) + tokens;
        if total > USAGE_WINDOW_TOKENS {
            // Racy with concurrent observations, which only blurs the window's edge.
            self.usage_bytes
                .store(self.usage_bytes.load(Relaxed) / 2, Relaxed);
            self.usage_tokens.store(total / 2, Relaxed);
        }
    }

    /// Request-string bytes per prompt token at this backend: learned from its answers once
    /// enough were seen, else [`DEFAULT_BYTES_PER_TOKEN`].
    pub fn bytes_per_token(&self) -> f64 {
        let tokens = self.usage_tokens.load(Relaxed);
        if tokens < MIN_USAGE_TOKENS {
            return DEFAULT_BYTES_PER_TOKEN;
        }
        (self.usage_bytes.load(Relaxed) as f64 / tokens as f64).clamp(0.25, 64.0)
    }

    pub fn kv_usage(&self) -> f64 {
        f64::from_bits(self.kv_usage_bits.load(Relaxed))
    }

    /// Records the backend's own KV-cache usage (0..1), with how much of it was ours.
    pub fn report_kv_usage(&self, usage: f64) {
        self.kv_tokens_at_report
            .store(self.kv_tokens.load(Relaxed), Relaxed);
        self.kv_usage_bits.store(usage.to_bits(), Relaxed);
    }

    /// KV-cache tokens in use there now: the others' as of the last scrape (the reported
    /// usage less ours at that time) plus ours counted live, as for waiting requests: the
    /// scrape is up to an interval old, and a burst sent since would not show in it. 0 while
    /// the cache's size is unknown.
    fn kv_tokens_in_use(&self) -> u64 {
        let cache = self.cache_tokens.load(Relaxed);
        if cache == 0 {
            return 0;
        }
        let reported = (self.kv_usage().clamp(0.0, 1.0) * cache as f64) as u64;
        let foreign = reported.saturating_sub(self.kv_tokens_at_report.load(Relaxed));
        foreign + self.kv_tokens.load(Relaxed)
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend").field("url", &self.url()).finish()
    }
}

impl Backend {
    /// Records the backend's own count of waiting requests, with how many of them were ours.
    pub fn report_waiting(&self, waiting: u64) {
        self.waiting_first_byte_at_report
            .store(self.own_waiting_first_byte(), Relaxed);
        self.reported_waiting.store(waiting, Relaxed);
    }

    fn own_waiting_first_byte(&self) -> u64 {
        self.waiting_first_byte.load(Relaxed) + self.remote.waiting_first_byte.load(Relaxed)
    }

    /// Requests waiting there that no router of ours sent, as of the last scrape. Our own are
    /// counted live instead: the scraped total is up to a scrape interval old, and judging by it
    /// held a drained backend "full" until the next scrape (on real vLLM the gateway queue
    /// then cost 17 % of the fleet's throughput).
    fn foreign_waiting(&self) -> u64 {
        self.reported_waiting
            .load(Relaxed)
            .saturating_sub(self.waiting_first_byte_at_report.load(Relaxed))
    }

    /// How long requests of ours (this router's or its replicas') have waited here without
    /// any first byte coming: a backend that has stopped answering (seen on real vLLM: one
    /// server held 15 requests for 5 s while the other gave 148 first bytes) looks as fast as
    /// ever to a learned prefill line, which only hears from the requests that finish; and a
    /// queue is worked on from when it formed, whichever replica sent to it. 0 while none of
    /// ours waits.
    pub fn stalled_secs(&self) -> f64 {
        if self.waiting_first_byte.load(Relaxed) == 0 && !self.remote.waiting_with_clock() {
            return 0.0;
        }
        let moved = self
            .progress_at
            .load(Relaxed)
            .max(self.remote.queue_moved_at.load(Relaxed));
        progress_clock().saturating_sub(moved) as f64 * 1e-9
    }

    /// Since this router last saw its prefill queue here move (what it tells its replicas).
    pub fn queue_moved_ago(&self) -> std::time::Duration {
        let since = progress_clock().saturating_sub(self.progress_at.load(Relaxed));
        std::time::Duration::from_nanos(since)
    }

    fn note_progress(&self) {
        self.progress_at.store(progress_clock(), Relaxed);
    }

    /// What a policy sees of this backend now (its match filled in later).
    pub fn row(&self) -> crate::core::policy::CandidateRow {
        crate::core::policy::CandidateRow {
            id: self.id,
            weight: self.weight(),
            inflight: self.inflight.load(Relaxed) + self.remote.inflight.load(Relaxed),
            waiting_first_byte: self.own_waiting_first_byte(),
            queue: self.reported_queue.load(Relaxed),
            entries: self.entries.load(Relaxed),
            matched_tokens: 0,
            queued_prefill_tokens: self.queued_prefill_tokens.load(Relaxed)
                + self.remote.queued_prefill_tokens.load(Relaxed),
            foreign_waiting: self.foreign_waiting(),
            kv_usage: self.kv_usage(),
            kv_tokens_in_use: self.kv_tokens_in_use(),
            kv_cache_tokens: self.cache_tokens.load(Relaxed),
            prefill: self.prefill.line(),
            prefill_observations: self.prefill.observations(),
            stalled_secs: self.stalled_secs(),
            matched_by: crate::core::policy::MatchedBy::None,
        }
    }
}

/// Nanoseconds on a process-wide monotonic clock, for timestamps kept in atomics.
fn progress_clock() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = *START.get_or_init(std::time::Instant::now);
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A backend's load held by the other router replicas (their sums): policies add it to this
/// router's own, so replicas balance one fleet instead of each its own share.
#[derive(Default, Debug)]
pub struct RemoteLoad {
    pub inflight: AtomicU64,
    pub waiting_first_byte: AtomicU64,
    pub queued_prefill_tokens: AtomicU64,
    /// When a replica last saw the prefill queue here move ([`progress_clock`] ns; 0: none
    /// said). Without it a queue a peer had sent was charged whole, as if just formed, and
    /// the siblings of a prefix being prefilled there went to backends without it (8 sims,
    /// shared-prefix, 4 replicas: hit rate 0.79–0.82 against one router's 0.86).
    queue_moved_at: AtomicU64,
}

impl RemoteLoad {
    /// A replica saw the prefill queue move `ago` (None: none of them said).
    pub fn set_queue_moved_ago(&self, ago: Option<std::time::Duration>) {
        let at = ago.map_or(0, |ago| {
            let ago = u64::try_from(ago.as_nanos()).unwrap_or(u64::MAX);
            progress_clock().saturating_sub(ago).max(1)
        });
        self.queue_moved_at.store(at, Relaxed);
    }

    /// Whether requests of the peers wait here and the peers said when the queue moved (peers
    /// of an earlier version do not: their queues then start no stall clock here).
    fn waiting_with_clock(&self) -> bool {
        self.waiting_first_byte.load(Relaxed) > 0 && self.queue_moved_at.load(Relaxed) > 0
    }
}

/// Called with the time to first byte of a request, when it comes.
pub type OnFirstByte = Box<dyn FnOnce(std::time::Duration) + Send + Sync>;
/// Called when a request ends (answered, failed or cancelled alike).
pub type OnEnd = Box<dyn FnOnce() + Send + Sync>;

/// Counts a request against a backend until dropped (finished, failed or cancelled alike),
/// so in-flight counters cannot leak.
pub struct InflightGuard {
    backend: Arc<Backend>,
    /// Whether it still counts in the backend's prefill queue: until its first byte, or (a
    /// whole answer, whose first byte comes only at its end) until its prefill is predicted
    /// done ([`InflightGuard::leave_prefill_queue_after`]), whichever is first.
    in_prefill_queue: Arc<AtomicBool>,
    /// The uncached prompt tokens it added to the backend's prefill queue.
    uncached: u64,
    sent: std::time::Instant,
    on_first_byte: Option<OnFirstByte>,
    on_end: Option<OnEnd>,
    /// The gateway queue's dispatcher, told when this request's load eases.
    load_eased: Option<Arc<tokio::sync::Notify>>,
    /// The timer that takes a whole answer out of the prefill queue, stopped with the request.
    prefill_timer: Option<tokio::task::AbortHandle>,
}

impl InflightGuard {
    /// A request with `uncached` prompt tokens to compute sent to `backend`.
    pub fn new(backend: Arc<Backend>, uncached: u64) -> Self {
        backend.inflight.fetch_add(1, Relaxed);
        if backend.waiting_first_byte.fetch_add(1, Relaxed) == 0
            && !backend.remote.waiting_with_clock()
        {
            // The stall clock starts with the first request of ours to wait here (a queue
            // another replica formed has been worked on since it formed).
            backend.note_progress();
        }
        backend.queued_prefill_tokens.fetch_add(uncached, Relaxed);
        backend.kv_tokens.fetch_add(uncached, Relaxed);
        Self {
            backend,
            in_prefill_queue: Arc::new(AtomicBool::new(true)),
            uncached,
            sent: std::time::Instant::now(),
            on_first_byte: None,
            on_end: None,
            load_eased: None,
            prefill_timer: None,
        }
    }

    /// Takes the request out of the backend's prefill queue `after` this long unless its first
    /// byte comes (or it ends) sooner. For a whole (not streamed) answer the first byte is its
    /// end: counted until then, its decode would look like prefill still queued, to the cost
    /// policy (which then sent requests away from the backends holding their prefix: sims,
    /// shared-prefix with whole answers, hit 0.63 against `prefix_load`'s 0.87) and to the
    /// gateway queue. Needs a tokio runtime.
    pub fn leave_prefill_queue_after(&mut self, after: std::time::Duration) {
        let queued = self.in_prefill_queue.clone();
        let backend = self.backend.clone();
        let uncached = self.uncached;
        let load_eased = self.load_eased.clone();
        let timer = tokio::spawn(async move {
            tokio::time::sleep(after).await;
            if queued.swap(false, Relaxed) {
                leave_prefill_queue(&backend, uncached, load_eased.as_deref());
            }
        });
        self.prefill_timer = Some(timer.abort_handle());
    }

    /// `notify` (the gateway queue's dispatcher) hears when this request's load eases: its
    /// first byte, its end.
    pub fn tell_when_load_eases(&mut self, notify: Option<Arc<tokio::sync::Notify>>) {
        self.load_eased = notify;
    }

    /// `f` gets the time to the first byte, if it comes (not when the request fails first).
    pub fn on_first_byte(&mut self, f: OnFirstByte) {
        self.on_first_byte = Some(f);
    }

    /// `f` is called when the request ends, after its load has left the backend.
    pub fn on_end(&mut self, f: OnEnd) {
        self.on_end = Some(f);
    }

    /// The first byte of the answer arrived; `learnable` when the answer is a success whose
    /// first frame is no error (an error comes at once, whatever the prompt: learned from, a
    /// refused 200 kB prompt made the backend's prefill look a thousand times faster).
    pub fn first_byte(&mut self, learnable: bool) {
        self.leave_prefill_queue();
        if let Some(f) = self.on_first_byte.take() {
            if learnable {
                f(self.sent.elapsed());
            }
        }
    }

    fn leave_prefill_queue(&self) {
        if self.in_prefill_queue.swap(false, Relaxed) {
            leave_prefill_queue(&self.backend, self.uncached, self.load_eased.as_deref());
        }
    }

    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }
}

/// A request of `uncached` tokens leaves `backend`'s prefill queue (once per request: the
/// callers' flag sees to that).
fn leave_prefill_queue(backend: &Backend, uncached: u64, load_eased: Option<&tokio::sync::Notify>) {
    backend.note_progress();
    backend.waiting_first_byte.fetch_sub(1, Relaxed);
    backend.queued_prefill_tokens.fetch_sub(uncached, Relaxed);
    tell_load_eased(load_eased);
}

/// Wakes the gateway queue's dispatcher, if the request came through it.
fn tell_load_eased(load_eased: Option<&tokio::sync::Notify>) {
    if let Some(n) = load_eased {
        n.notify_one();
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if let Some(timer) = self.prefill_timer.take() {
            timer.abort();
        }
        // Ended without a first byte: no TTFT to learn from.
        self.leave_prefill_queue();
        self.backend.inflight.fetch_sub(1, Relaxed);
        self.backend.kv_tokens.fetch_sub(self.uncached, Relaxed);
        tell_load_eased(self.load_eased.as_deref());
        if let Some(f) = self.on_end.take() {
            f();
        }
    }
}

/// The current set of backends, replaced whole when it changes so readers never lock.
#[derive(Default)]
pub struct Fleet {
    backends: ArcSwap<Vec<Arc<Backend>>>,
    /// The same backends by server id (bus messages and events name backends by id).
    by_id: ArcSwap<HashMap<u64, Arc<Backend>>>,
}

/// What a reconcile changed.
#[derive(Default, Debug)]
pub struct FleetChange {
    pub added: Vec<Arc<Backend>>,
    pub removed: Vec<Arc<Backend>>,
    /// Same URL, other settings: updated in place.
    pub updated: Vec<Arc<Backend>>,
}

impl Fleet {
    pub fn snapshot(&self) -> arc_swap::Guard<Arc<Vec<Arc<Backend>>>> {
        self.backends.load()
    }

    pub fn all(&self) -> Arc<Vec<Arc<Backend>>> {
        self.backends.load_full()
    }

    /// The backend with this server id, if it is in the fleet.
    pub fn by_id(&self, id: u64) -> Option<Arc<Backend>> {
        self.by_id.load().get(&id).cloned()
    }

    /// Makes the fleet exactly `specs`. A backend keeps its state for as long as its URL is
    /// listed, whatever else of its settings changes.
    pub fn reconcile(
        &self,
        specs: &[BackendSpec],
        default_capacity: u64,
    ) -> anyhow::Result<FleetChange> {
        let current = self.backends.load_full();
        let mut next = Vec::with_capacity(specs.len());
        let mut change = FleetChange::default();
        for spec in specs {
            if next.iter().any(|b: &Arc<Backend>| *b.label == *spec.url) {
                continue; // listed twice
            }
            match current.iter().find(|b| *b.label == *spec.url) {
                Some(existing) => {
                    if *existing.spec() != *spec {
                        existing.update(spec.clone())?;
                        change.updated.push(existing.clone());
                    }
                    next.push(existing.clone());
                }
                None => {
                    let backend = Arc::new(Backend::new(spec.clone(), default_capacity)?);
                    change.added.push(backend.clone());
                    next.push(backend);
                }
            }
        }
        for old in current.iter() {
            if !next.iter().any(|b| b.label == old.label) {
                change.removed.push(old.clone());
            }
        }
        let by_id = next.iter().map(|b| (b.id, b.clone())).collect();
        self.backends.store(Arc::new(next));
        self.by_id.store(Arc::new(by_id));
        Ok(change)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_normalize_and_ids_are_stable() {
        assert_eq!(normalize_url("HTTP://Host:8000/"), "http://host:8000");
        assert_eq!(normalize_url("host:8000"), "http://host:8000");
        assert_eq!(normalize_url("http://h/v1/"), "http://h/v1");
        assert_eq!(
            server_id("http://Host:8000/"),
            server_id("http://host:8000")
        );
        assert_ne!(server_id("http://a:1"), server_id("http://a:2"));
    }

    #[test]
    fn a_backend_with_models_to_discover_is_no_candidate_before_its_first_check() {
        let discovered = Backend::new(BackendSpec::new("http://a:1"), 10).unwrap();
        assert!(!discovered.is_healthy());
        assert!(
            discovered.record_success(),
            "the first good check admits it"
        );
        assert!(discovered.is_healthy());
        let mut spec = BackendSpec::new("http://a:2");
        spec.models = Some(vec!["m".into()]);
        let configured = Backend::new(spec, 10).unwrap();
        assert!(configured.is_healthy() && configured.serves("m").is_some());
    }

    #[test]
    fn our_own_waiting_requests_are_counted_live_not_from_the_last_scrape() {
        let b = Backend::new(BackendSpec::new("http://a:1"), 10).unwrap();
        b.waiting_first_byte.store(3, Relaxed);
        b.report_waiting(3);
        assert_eq!(b.row().foreign_waiting, 0, "all three are ours");
        // Ours got their first bytes since the scrape: nothing waits there now, whatever the
        // scrape said.
        b.waiting_first_byte.store(0, Relaxed);
        assert_eq!(
            (b.row().waiting_first_byte, b.row().foreign_waiting),
            (0, 0)
        );
        // Five waiting when three were ours: two another router sent.
        b.waiting_first_byte.store(3, Relaxed);
        b.report_waiting(5);
        b.waiting_first_byte.store(1, Relaxed);
        assert_eq!(
            (b.row().waiting_first_byte, b.row().foreign_waiting),
            (1, 2)
        );
    }

    #[test]
    fn kv_use_is_the_others_as_reported_plus_ours_live() {
        let b = Arc::new(Backend::new(BackendSpec::new("http://a:1"), 10).unwrap());
        let first = InflightGuard::new(b.clone(), 1_000);
        assert_eq!(b.row().kv_tokens_in_use, 0, "cache size not known yet");
        b.cache_tokens.store(10_000, Relaxed);
        assert_eq!(b.row().kv_tokens_in_use, 1_000, "ours, before any report");
        // 30 % in use when 1,000 tokens were ours: 2,000 are another router's.
        b.report_kv_usage(0.3);
        let second = InflightGuard::new(b.clone(), 500);
        assert_eq!(b.row().kv_tokens_in_use, 3_500);
        drop(first);
        drop(second);
        assert_eq!(b.row().kv_tokens_in_use, 2_000, "ours freed at once");
        b.report_kv_usage(0.0);
        assert_eq!(b.row().kv_tokens_in_use, 0);
    }

    #[test]
    fn the_stall_clock_runs_while_ours_wait_and_restarts_at_each_first_byte() {
        let pause = std::time::Duration::from_millis(30);
        let b = Arc::new(Backend::new(BackendSpec::new("http://a:1"), 10).unwrap());
        std::thread::sleep(pause);
        assert_eq!(b.stalled_secs(), 0.0, "idle: no stall, however long");
        let mut first = InflightGuard::new(b.clone(), 10);
        let second = InflightGuard::new(b.clone(), 10);
        let at_send = b.stalled_secs();
        std::thread::sleep(pause);
        let waited = b.row().stalled_secs;
        assert!(
            waited >= 0.03 && waited > at_send,
            "{at_send} then {waited}"
        );
        first.first_byte(true);
        assert!(b.stalled_secs() < waited, "a first byte is progress");
        drop(second);
        assert_eq!(b.stalled_secs(), 0.0, "none of ours waits");
    }

    #[test]
    fn a_queue_a_replica_formed_is_worked_on_from_when_it_formed() {
        let b = Arc::new(Backend::new(BackendSpec::new("http://a:1"), 10).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(100));
        // A peer's request has waited here 80 ms; none of this router's.
        b.remote.waiting_first_byte.store(1, Relaxed);
        b.remote
            .set_queue_moved_ago(Some(std::time::Duration::from_millis(80)));
        let stalled = b.stalled_secs();
        assert!((0.08..0.5).contains(&stalled), "{stalled}");
        // A request of ours joins that queue: its clock does not start over.
        let ours = InflightGuard::new(b.clone(), 10);
        assert!(b.stalled_secs() >= stalled, "{}", b.stalled_secs());
        // The peer's request got its first byte (its table says the queue moved just now).
        b.remote.waiting_first_byte.store(0, Relaxed);
        b.remote
            .set_queue_moved_ago(Some(std::time::Duration::ZERO));
        assert!(b.stalled_secs() < 0.05, "{}", b.stalled_secs());
        drop(ours);
        assert_eq!(b.stalled_secs(), 0.0, "nothing waits");
    }

    #[test]
    fn guard_counts_exactly() {
        let b = Arc::new(Backend::new(BackendSpec::new("http://a:1"), 10).unwrap());
        let mut g = InflightGuard::new(b.clone(), 700);
        let ttfts = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let seen = ttfts.clone();
        g.on_first_byte(Box::new(move |t| seen.lock().push(t)));
        let mut other = InflightGuard::new(b.clone(), 300);
        assert_eq!(
            (
                b.inflight.load(Relaxed),
                b.waiting_first_byte.load(Relaxed),
                b.queued_prefill_tokens.load(Relaxed)
            ),
            (2, 2, 1000)
        );
        g.first_byte(true);
        g.first_byte(true);
        assert_eq!(ttfts.lock().len(), 1, "the first byte is reported once");
        assert_eq!(
            (
                b.waiting_first_byte.load(Relaxed),
                b.queued_prefill_tokens.load(Relaxed)
            ),
            (1, 300)
        );
        drop(g);
        assert_eq!(b.inflight.load(Relaxed), 1);
        // A request that fails before answering leaves the queue too.
        other.on_first_byte(Box::new(|_| panic!("no first byte came")));
        drop(other);
        drop(InflightGuard::new(b.clone(), 5));
        assert_eq!(
            (
                b.inflight.load(Relaxed),
                b.waiting_first_byte.load(Relaxed),
                b.queued_prefill_tokens.load(Relaxed)
            ),
            (0, 0, 0)
        );
    }

    #[tokio::test]
    async fn a_whole_answer_leaves_the_prefill_queue_when_its_prefill_is_due() {
        let b = Arc::new(Backend::new(BackendSpec::new("http://a:1"), 10).unwrap());
        let queued = |b: &Backend| {
            (
                b.waiting_first_byte.load(Relaxed),
                b.queued_prefill_tokens.load(Relaxed),
            )
        };
        let due = std::time::Duration::from_millis(20);
        let mut whole = InflightGuard::new(b.clone(), 700);
        whole.leave_prefill_queue_after(due);
        assert_eq!(queued(&b), (1, 700), "queued until its prefill is due");
        tokio::time::sleep(due * 10).await;
        assert_eq!(
            queued(&b),
            (0, 0),
            "its prefill is due: decoding, not queued"
        );
        assert_eq!(b.inflight.load(Relaxed), 1, "still in flight");
        // Its answer's end (its first byte) and its drop do not take it out a second time.
        let other = InflightGuard::new(b.clone(), 300);
        whole.first_byte(true);
        drop(whole);
        assert_eq!(queued(&b), (1, 300));
        assert_eq!(b.inflight.load(Relaxed), 1);
        drop(other);
        // One whose answer comes (or that ends) first leaves once, and its timer is stopped.
        let mut early = InflightGuard::new(b.clone(), 500);
        early.leave_prefill_queue_after(due);
        early.first_byte(true);
        let mut cancelled = InflightGuard::new(b.clone(), 200);
        cancelled.leave_prefill_queue_after(due);
        drop(cancelled);
        assert_eq!(queued(&b), (0, 0));
        tokio::time::sleep(due * 10).await;
        assert_eq!(queued(&b), (0, 0), "the timers took nothing twice");
        drop(early);
        assert_eq!(b.inflight.load(Relaxed), 0);
    }

    #[test]
    fn reconcile_keeps_state_and_reports_changes() {
        let fleet = Fleet::default();
        let a = BackendSpec::new("http://a:1");
        let b = BackendSpec::new("http://b:1");
        let change = fleet.reconcile(&[a.clone(), b.clone()], 10).unwrap();
        assert_eq!(change.added.len(), 2);
        let a_state = fleet.all()[0].clone();
        a_state.inflight.fetch_add(3, Relaxed);
        let change = fleet.reconcile(std::slice::from_ref(&a), 10).unwrap();
        assert_eq!((change.added.len(), change.removed.len()), (0, 1));
        assert_eq!(fleet.all()[0].inflight.load(Relaxed), 3);
        assert!(Backend::new(BackendSpec::new("https://x"), 1).is_err());
    }

    #[test]
    fn a_settings_change_keeps_the_live_state() {
        let fleet = Fleet::default();
        let mut spec = BackendSpec::new("http://a:1");
        spec.models = Some(vec!["m".into()]);
        fleet.reconcile(std::slice::from_ref(&spec), 10).unwrap();
        let before = fleet.all()[0].clone();
        let running = InflightGuard::new(before.clone(), 0);
        spec.weight = 4;
        spec.capacity = Some(77);
        let change = fleet.reconcile(std::slice::from_ref(&spec), 10).unwrap();
        assert_eq!(
            (
                change.added.len(),
                change.removed.len(),
                change.updated.len()
            ),
            (0, 0, 1)
        );
        let after = fleet.all()[0].clone();
        assert!(Arc::ptr_eq(&before, &after), "the same backend, updated");
        assert_eq!(
            after.inflight.load(Relaxed),
            1,
            "the running request still counts"
        );
        assert!(after.is_healthy() && after.serves("m").is_some());
        assert_eq!((after.weight(), after.capacity.load(Relaxed)), (4, 77));
        drop(running);
        assert_eq!(after.inflight.load(Relaxed), 0);
    }
}
