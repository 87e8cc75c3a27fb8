//! Precise matches: each backend's own KV-cache events (vLLM's ZMQ publisher) kept in a
//! token-block index, so a request's match is what the backend really holds, not a guess.
//!
//! One feed per backend subscribes to its publisher and applies every batch. A backend is
//! matched from events only while its feed is *live*: connected, and its view complete — it
//! saw the publisher from its first message (sequence 0), or the cache was emptied since, or
//! the warm-up after a late start or a sequence gap has passed (blocks cached before that stay
//! unknown until they are computed again). Otherwise the string index answers for it.
//!
//! Right after a request is routed, the chosen backend is credited with the request's blocks
//! for a short time (`--kv-credit`), so that a burst of siblings co-locates before the backend
//! has computed the prefix and said so.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use prefix_index::{BlockHasher, BlockIndex, ServerId};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use vllm_protocol::{EventBatch, KvEvent, Subscriber};

use super::backend::Backend;

/// Blocks kept for one backend at most (a publisher that never reports removals cannot grow
/// the index without bound).
const MAX_BLOCKS_PER_BACKEND: usize = 4 << 20;
/// Recent routings credited per backend at most.
const MAX_CREDITS: usize = 256;

/// How the events are followed.
#[derive(Clone, Debug)]
pub struct EventSettings {
    /// A backend seen from the middle of its stream (a late start, a gap) is trusted after this.
    pub warmup: Duration,
    /// How long a routed request's blocks count as held before the backend reports them.
    pub credit: Duration,
    /// The hash seed of block names (as the string index's).
    pub seed: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

struct EventMetrics {
    events: Family<KindLabels, Counter>,
    gaps: Counter,
    lag: Histogram,
    feeds: Family<StateLabels, Gauge>,
    blocks: Gauge,
}

impl EventMetrics {
    fn register(r: &mut Registry) -> Self {
        let m = Self {
            events: Family::default(),
            gaps: Counter::default(),
            // 100 µs .. ~100 s
            lag: Histogram::new(exponential_buckets(1e-4, 2.0, 20)),
            feeds: Family::default(),
            blocks: Gauge::default(),
        };
        r.register(
            "prefix_router_kv_events",
            "KV-cache events received, by kind (stored, removed, cleared; skipped: not applicable or unreadable)",
            m.events.clone(),
        );
        r.register(
            "prefix_router_kv_event_gaps",
            "Sequence gaps and publisher restarts seen (the backend is re-learned)",
            m.gaps.clone(),
        );
        r.register(
            "prefix_router_kv_event_lag_seconds",
            "Time from a batch's publication to its arrival here",
            m.lag.clone(),
        );
        r.register(
            "prefix_router_kv_event_feeds",
            "Backends' event feeds by state (live: matched from events; warming, down: by the string index)",
            m.feeds.clone(),
        );
        r.register(
            "prefix_router_kv_blocks",
            "Blocks in the token-block index",
            m.blocks.clone(),
        );
        m
    }

    fn count(&self, kind: &'static str, n: u64) {
        if n > 0 {
            self.events.get_or_create(&KindLabels { kind }).inc_by(n);
        }
    }
}

const DOWN: u8 = 0;
const WARMING: u8 = 1;
const LIVE: u8 = 2;

/// One backend's feed as the request path reads it (lock-free), and its credits.
#[derive(Default)]
struct FeedState {
    state: AtomicU8,
    /// When a warming feed becomes live (ms since the index's start).
    live_at_ms: AtomicU64,
    connected: AtomicBool,
    /// Recent routings here: (until, block names), oldest first.
    credits: Mutex<VecDeque<(Instant, Arc<[u64]>)>>,
}

/// A running subscription.
struct Task {
    endpoint: String,
    handle: tokio::task::AbortHandle,
}

/// The token-block index fed by the backends' events.
pub struct KvEvents {
    /// Created at the first stored block (vLLM's block size); until then nothing is live.
    index: OnceLock<BlockIndex>,
    /// Read on every request without a lock; replaced whole when feeds come and go.
    feeds: ArcSwap<HashMap<ServerId, Arc<FeedState>>>,
    tasks: Mutex<HashMap<ServerId, Task>>,
    settings: EventSettings,
    metrics: EventMetrics,
    started: Instant,
}

impl KvEvents {
    pub fn new(settings: EventSettings, registry: &mut Registry) -> Arc<Self> {
        Arc::new(Self {
            index: OnceLock::new(),
            feeds: ArcSwap::default(),
            tasks: Mutex::default(),
            metrics: EventMetrics::register(registry),
            settings,
            started: Instant::now(),
        })
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The block names of a request's tokens (None until the block size is known).
    pub fn names(&self, tokens: &[u32]) -> Option<Vec<u64>> {
        Some(self.index.get()?.hasher().hash(tokens))
    }

    /// Whether a feed is matched from its events now.
    fn is_live(&self, feed: &FeedState) -> bool {
        match feed.state.load(Relaxed) {
            LIVE => true,
            WARMING if self.now_ms() >= feed.live_at_ms.load(Relaxed) => {
                feed.state.store(LIVE, Relaxed);
                true
            }
            _ => false,
        }
    }

    /// Whether `backend` is matched from its events now.
    pub fn live(&self, backend: ServerId) -> bool {
        self.feeds
            .load()
            .get(&backend)
            .is_some_and(|f| self.is_live(f))
    }

    /// For each candidate, the prompt tokens it holds by its events (with credits), or None
    /// where its feed is not live.
    pub fn matches(
        &self,
        names: &[u64],
        tokens: usize,
        candidates: &[Arc<Backend>],
    ) -> Vec<Option<u64>> {
        let Some(index) = self.index.get() else {
            return vec![None; candidates.len()];
        };
        let feeds = self.feeds.load();
        let live: Vec<Option<&Arc<FeedState>>> = candidates
            .iter()
            .map(|b| feeds.get(&b.id).filter(|f| self.is_live(f)))
            .collect();
        if live.iter().all(Option::is_none) {
            return vec![None; candidates.len()];
        }
        let ids: Vec<ServerId> = candidates.iter().map(|b| b.id).collect();
        let held = index.matches(names, &ids);
        let block = index.hasher().block_size() as u64;
        // vLLM computes at least the last prompt token.
        let usable = (tokens as u64).saturating_sub(1) / block;
        let now = Instant::now();
        live.iter()
            .enumerate()
            .map(|(i, feed)| {
                let feed = (*feed)?;
                let credited = feed
                    .credits
                    .lock()
                    .iter()
                    .filter(|(until, _)| *until > now)
                    .map(|(_, seq)| seq.iter().zip(names).take_while(|(a, b)| a == b).count())
                    .max()
                    .unwrap_or(0) as u64;
                Some(held[i].max(credited).min(usable) * block)
            })
            .collect()
    }

    /// A request whose blocks are `names` went to `backend`: credit them for a while.
    pub fn credit(&self, backend: ServerId, names: Arc<[u64]>) {
        if names.is_empty() || self.settings.credit.is_zero() {
            return;
        }
        let feeds = self.feeds.load();
        let Some(feed) = feeds.get(&backend) else {
            return;
        };
        let now = Instant::now();
        let mut list = feed.credits.lock();
        while list.front().is_some_and(|(until, _)| *until <= now) || list.len() >= MAX_CREDITS {
            list.pop_front();
        }
        list.push_back((now + self.settings.credit, names));
    }

    /// Follows the fleet: a feed for every backend with a publisher, none for the others.
    pub fn sync(
        self: &Arc<Self>,
        backends: &[Arc<Backend>],
        endpoint: impl Fn(&Backend) -> Option<String>,
    ) {
        let mut tasks = self.tasks.lock();
        let wanted: HashMap<ServerId, String> = backends
            .iter()
            .filter_map(|b| Some((b.id, endpoint(b)?)))
            .collect();
        let mut feeds: HashMap<ServerId, Arc<FeedState>> = (**self.feeds.load()).clone();
        tasks.retain(|id, task| {
            let keep = wanted.get(id) == Some(&task.endpoint);
            if !keep {
                task.handle.abort();
                feeds.remove(id);
                self.forget_blocks(*id);
            }
            keep
        });
        for (id, endpoint) in wanted {
            if tasks.contains_key(&id) {
                continue;
            }
            let state = Arc::new(FeedState::default());
            let handle = tokio::spawn(follow(
                Arc::downgrade(self),
                id,
                endpoint.clone(),
                state.clone(),
            ))
            .abort_handle();
            feeds.insert(id, state);
            tasks.insert(id, Task { endpoint, handle });
        }
        self.feeds.store(Arc::new(feeds));
    }

    /// The backend's cache is gone (it failed, or left): its blocks and credits go, and it is
    /// matched by the string index until its feed is live again.
    pub fn forget(&self, backend: ServerId) {
        if let Some(feed) = self.feeds.load().get(&backend) {
            self.warm_up(feed);
        }
        self.forget_blocks(backend);
    }

    fn forget_blocks(&self, backend: ServerId) {
        if let Some(index) = self.index.get() {
            index.clear(backend);
        }
        if let Some(feed) = self.feeds.load().get(&backend) {
            feed.credits.lock().clear();
        }
    }

    fn warm_up(&self, state: &FeedState) {
        state.live_at_ms.store(
            self.now_ms() + self.settings.warmup.as_millis() as u64,
            Relaxed,
        );
        state.state.store(WARMING, Relaxed);
    }

    /// Refreshes the gauges (before a scrape).
    pub fn observe(&self) {
        let mut counts = [0i64; 3];
        for feed in self.feeds.load().values() {
            let state = if !feed.connected.load(Relaxed) {
                DOWN
            } else if self.is_live(feed) {
                LIVE
            } else {
                WARMING
            };
            counts[state as usize] += 1;
        }
        for (state, label) in [(DOWN, "down"), (WARMING, "warming"), (LIVE, "live")] {
            self.metrics
                .feeds
                .get_or_create(&StateLabels { state: label })
                .set(counts[state as usize]);
        }
        if let Some(index) = self.index.get() {
            self.metrics.blocks.set(index.total_blocks() as i64);
        }
    }

    /// Applies one batch of `backend`'s events.
    fn apply(&self, backend: ServerId, batch: &EventBatch) -> bool {
        let m = &self.metrics;
        m.count("skipped", batch.skipped.len() as u64);
        let mut cleared = false;
        for event in &batch.events {
            match event {
                KvEvent::Stored(s)
                    if s.medium.as_deref().is_none_or(|m| m == "GPU")
                        && s.lora.is_none()
                        && !s.extra_keys =>
                {
                    let index = self.index.get_or_init(|| {
                        BlockIndex::new(
                            BlockHasher::new(s.block_size as usize, self.settings.seed),
                            MAX_BLOCKS_PER_BACKEND,
                        )
                    });
                    let hashes: Vec<u64> = s.block_hashes.iter().map(|h| h.0).collect();
                    match index.stored(
                        backend,
                        s.parent.map(|p| p.0),
                        &hashes,
                        &s.token_ids,
                        s.block_size as usize,
                    ) {
                        Ok(_) => m.count("stored", 1),
                        Err(_) => m.count("skipped", 1),
                    }
                }
                KvEvent::Stored(_) => m.count("skipped", 1),
                KvEvent::Removed(r) => {
                    if let Some(index) = self.index.get() {
                        let hashes: Vec<u64> = r.block_hashes.iter().map(|h| h.0).collect();
                        index.removed(backend, &hashes);
                    }
                    m.count("removed", 1);
                }
                KvEvent::AllCleared => {
                    self.forget_blocks(backend);
                    cleared = true;
                    m.count("cleared", 1);
                }
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        if batch.ts > 0.0 {
            m.lag.observe((now - batch.ts).max(0.0));
        }
        cleared
    }
}

/// One backend's feed: subscribes (again after a failure), applies batches, watches the
/// sequence numbers. Ends when the index is dropped or the feed aborted.
async fn follow(
    events: std::sync::Weak<KvEvents>,
    backend: ServerId,
    endpoint: String,
    state: Arc<FeedState>,
) {
    let mut backoff = Duration::from_millis(200);
    loop {
        let mut sub = match Subscriber::connect(&endpoint, Duration::from_secs(2)).await {
            Ok(sub) => sub,
            Err(e) => {
                tracing::debug!(endpoint, error = %e, "KV events: no publisher yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        state.connected.store(true, Relaxed);
        let mut last: Option<u64> = None;
        loop {
            let message = match sub.next().await {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(endpoint, error = %e, "KV events: the subscription failed; reconnecting");
                    break;
                }
            };
            let Some(events) = events.upgrade() else {
                return;
            };
            let message = match message {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!(endpoint, error = %e, "KV events: an unreadable message");
                    events.metrics.count("skipped", 1);
                    continue;
                }
            };
            match last {
                // The first message: complete history only if the publisher just began.
                None if message.seq == 0 => state.state.store(LIVE, Relaxed),
                None => {
                    tracing::info!(
                        endpoint,
                        seq = message.seq,
                        "KV events: joined a running publisher; warming up"
                    );
                    events.warm_up(&state);
                }
                Some(prev) if message.seq == prev + 1 => {}
                Some(prev) => {
                    // A gap (lost messages) or a restarted publisher (a new, empty cache).
                    tracing::warn!(
                        endpoint,
                        expected = prev + 1,
                        got = message.seq,
                        "KV events: sequence gap; re-learning the backend"
                    );
                    events.metrics.gaps.inc();
                    events.forget_blocks(backend);
                    if message.seq == 0 {
                        state.state.store(LIVE, Relaxed);
                    } else {
                        events.warm_up(&state);
                    }
                }
            }
            last = Some(message.seq);
            if events.apply(backend, &message.batch) {
                // An emptied cache is known exactly from here.
                state.state.store(LIVE, Relaxed);
            }
        }
        state.connected.store(false, Relaxed);
        state.state.store(DOWN, Relaxed);
        tokio::time::sleep(backoff).await;
    }
}
