//! Precise matches: each backend's own KV-cache events (vLLM's ZMQ publisher) kept in a
//! token-block index, so a request's match is what the backend really holds, not a guess.
//!
//! One feed per backend subscribes to its publisher and applies every batch. A backend is
//! matched from events only while its feed is *live*: connected, and its view complete — it
//! saw the publisher from its first message (sequence 0), or the cache was emptied since, or
//! the warm-up after connecting or after a sequence gap has passed (blocks cached before that
//! stay unknown until they are computed again). Otherwise the string index answers for it.
//!
//! Where the publisher has a replay socket (vLLM's `replay_endpoint`), what a feed missed is
//! asked for instead: a sequence gap is filled in without forgetting anything, and a feed that
//! joins a publisher whose buffer still reaches its first batch is complete at once.
//!
//! Right after a request is routed, the chosen backend is credited with the request's blocks
//! for a short time (`--kv-credit`), so that a burst of siblings co-locates before the backend
//! has computed the prefix and said so.
//!
//! Each backend's block size is its own (read from its events: another model, another vLLM
//! setting), and so is the index its blocks live in: a request is named once per block size
//! among its candidates. A feed is only used while its reports apply: one whose block size is
//! not known yet, or whose stores keep failing, is matched by the string index instead.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
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
use vllm_protocol::{EventBatch, FrameLimits, KvEvent, Received, Replayed, Subscriber};

use super::backend::Backend;

/// Blocks kept for one backend at most (a publisher that never reports removals cannot grow
/// the index without bound).
const MAX_BLOCKS_PER_BACKEND: usize = 4 << 20;
/// Recent routings credited per backend at most.
const MAX_CREDITS: usize = 256;
/// A replay (up to vLLM's 10,000 buffered batches) that takes longer is given up.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// A feed whose last this many stores all failed (parents never seen, ragged blocks, the
/// per-backend bound) is not matched from: its index no longer says what the backend holds.
const MAX_FAILED_STORES: u32 = 8;
/// A sequence number this far behind the last one is no replayed batch but a renumbered
/// publisher (or a broken one): the feed starts over instead of dropping everything after it.
const MAX_BEHIND: u64 = 1 << 20;

/// Where a backend's events come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedEndpoints {
    /// The publisher (ZMQ PUB), e.g. `tcp://10.0.0.5:5557`.
    pub events: String,
    /// Its replay socket (ZMQ ROUTER), if it has one.
    pub replay: Option<String>,
}

/// How the events are followed.
#[derive(Clone, Debug)]
pub struct EventSettings {
    /// A backend seen from the middle of its stream (a late start, a gap) is trusted after this.
    pub warmup: Duration,
    /// How long a routed request's blocks count as held before the backend reports them.
    pub credit: Duration,
    /// The hash seed of block names (as the string index's).
    pub seed: u64,
    /// The largest message (and frame) accepted from a publisher or its replay socket.
    pub max_message: usize,
}

/// A request's token-block names, per block size among its candidates (one in most fleets).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockNames(Vec<(u32, Arc<[u64]>)>);

impl BlockNames {
    /// The names under one block size.
    pub fn of_size(names: Arc<[u64]>, block_size: u32) -> Self {
        Self(vec![(block_size, names)])
    }

    /// The names of blocks of `block_size` tokens, if the request was named so.
    pub fn sized(&self, block_size: u32) -> Option<&Arc<[u64]>> {
        self.0
            .iter()
            .find(|(size, _)| *size == block_size)
            .map(|(_, n)| n)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

struct EventMetrics {
    events: Family<KindLabels, Counter>,
    gaps: Counter,
    replays: Family<OutcomeLabels, Counter>,
    lag: Histogram,
    feeds: Family<StateLabels, Gauge>,
    blocks: Gauge,
    bytes: Gauge,
}

impl EventMetrics {
    fn register(r: &mut Registry) -> Self {
        let m = Self {
            events: Family::default(),
            gaps: Counter::default(),
            replays: Family::default(),
            // 100 µs .. ~100 s
            lag: Histogram::new(exponential_buckets(1e-4, 2.0, 20)),
            feeds: Family::default(),
            blocks: Gauge::default(),
            bytes: Gauge::default(),
        };
        r.register(
            "prefix_router_kv_events",
            "KV-cache events received, by kind (stored, removed, cleared; failed: a store that could not apply; skipped: not for the prefix cache, or unreadable; unknown_blocks: removed blocks never stored here; behind: a batch already applied; refused: a publisher disconnected for breaking the protocol or the size limits)",
            m.events.clone(),
        );
        r.register(
            "prefix_router_kv_event_gaps",
            "Sequence gaps and publisher restarts seen (the backend is re-learned)",
            m.gaps.clone(),
        );
        r.register(
            "prefix_router_kv_event_replays",
            "Missed batches asked for again from a publisher's replay socket, by outcome (filled; lost: no longer buffered; failed)",
            m.replays.clone(),
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
        r.register(
            "prefix_router_kv_index_bytes",
            "Memory the token-block index's tables take",
            m.bytes.clone(),
        );
        m
    }

    fn count(&self, kind: &'static str, n: u64) {
        if n > 0 {
            self.events.get_or_create(&KindLabels { kind }).inc_by(n);
        }
    }

    fn replayed(&self, outcome: &'static str) {
        self.replays.get_or_create(&OutcomeLabels { outcome }).inc();
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
    /// The backend's block size as its events say (0: no block stored yet).
    block_size: AtomicU32,
    /// Stores that failed since the last one that applied.
    failed_stores: AtomicU32,
    /// Recent routings here: (until, block names), oldest first.
    credits: Mutex<VecDeque<(Instant, Arc<[u64]>)>>,
}

impl FeedState {
    /// The block size its index answers under, if its reports apply.
    fn usable_block_size(&self) -> Option<u32> {
        let size = self.block_size.load(Relaxed);
        (size > 0 && self.failed_stores.load(Relaxed) < MAX_FAILED_STORES).then_some(size)
    }
}

/// A running subscription.
struct Task {
    endpoints: FeedEndpoints,
    handle: tokio::task::AbortHandle,
}

/// The token-block index fed by the backends' events.
pub struct KvEvents {
    /// One index per block size, created at the first block stored of that size.
    indexes: ArcSwap<Vec<(u32, Arc<BlockIndex>)>>,
    creating: Mutex<()>,
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
            indexes: ArcSwap::default(),
            creating: Mutex::new(()),
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

    /// The index of blocks of `block_size` tokens, if one was created.
    fn index(&self, block_size: u32) -> Option<Arc<BlockIndex>> {
        self.indexes
            .load()
            .iter()
            .find(|(size, _)| *size == block_size)
            .map(|(_, i)| i.clone())
    }

    /// The index of blocks of `block_size` tokens, created if needed.
    fn index_or_new(&self, block_size: u32) -> Arc<BlockIndex> {
        if let Some(index) = self.index(block_size) {
            return index;
        }
        let _creating = self.creating.lock();
        if let Some(index) = self.index(block_size) {
            return index;
        }
        let index = Arc::new(BlockIndex::new(
            BlockHasher::new(block_size as usize, self.settings.seed),
            MAX_BLOCKS_PER_BACKEND,
        ));
        let mut all = (**self.indexes.load()).clone();
        all.push((block_size, index.clone()));
        self.indexes.store(Arc::new(all));
        index
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
            .is_some_and(|f| self.is_live(f) && f.usable_block_size().is_some())
    }

    /// The block size of `backend`'s events, once known.
    pub fn block_size(&self, backend: ServerId) -> Option<u32> {
        let size = self.feeds.load().get(&backend)?.block_size.load(Relaxed);
        (size > 0).then_some(size)
    }

    /// For each candidate, the prompt tokens it holds by its events (with credits), or None
    /// where its feed is not usable now (not live, no block size known yet, failing stores);
    /// and the request's block names under each block size that answered.
    pub fn matches(
        &self,
        tokens: &[u32],
        candidates: &[Arc<Backend>],
    ) -> (Vec<Option<u64>>, BlockNames) {
        let feeds = self.feeds.load();
        let usable: Vec<Option<(&Arc<FeedState>, u32)>> = candidates
            .iter()
            .map(|b| {
                let feed = feeds.get(&b.id).filter(|f| self.is_live(f))?;
                Some((feed, feed.usable_block_size()?))
            })
            .collect();
        let mut out = vec![None; candidates.len()];
        let mut names = BlockNames::default();
        let now = Instant::now();
        for (i, used) in usable.iter().enumerate() {
            let Some((_, size)) = *used else { continue };
            if names.sized(size).is_some() {
                continue;
            }
            // The first candidate of a block size: name the request once for all of them.
            let Some(index) = self.index(size) else {
                continue;
            };
            let sized: Arc<[u64]> = index.hasher().hash(tokens).into();
            let of_size: Vec<usize> = (i..candidates.len())
                .filter(|&j| usable[j].is_some_and(|(_, s)| s == size))
                .collect();
            let ids: Vec<ServerId> = of_size.iter().map(|&j| candidates[j].id).collect();
            let held = index.matches(&sized, &ids);
            // vLLM computes at least the last prompt token.
            let usable_blocks = (tokens.len() as u64).saturating_sub(1) / u64::from(size);
            for (k, &j) in of_size.iter().enumerate() {
                let (feed, _) = usable[j].expect("filtered");
                let mut best = held[k];
                for (until, seq) in feed.credits.lock().iter() {
                    if best as usize >= sized.len() {
                        break;
                    }
                    if *until > now {
                        let common = seq
                            .iter()
                            .zip(sized.iter())
                            .take_while(|(a, b)| a == b)
                            .count();
                        best = best.max(common as u64);
                    }
                }
                out[j] = Some(best.min(usable_blocks) * u64::from(size));
            }
            names.0.push((size, sized));
        }
        (out, names)
    }

    /// A request named `names` went to `backend`: credit its blocks for a while.
    pub fn credit(&self, backend: ServerId, names: &BlockNames) {
        let Some(size) = self.block_size(backend) else {
            return;
        };
        if let Some(sized) = names.sized(size) {
            self.credit_sized(backend, size, sized.clone());
        }
    }

    /// Credits `backend` with blocks of `block_size` tokens named `names` (another replica's
    /// decision), if that is the backend's block size.
    pub fn credit_sized(&self, backend: ServerId, block_size: u32, names: Arc<[u64]>) {
        if names.is_empty() || self.settings.credit.is_zero() {
            return;
        }
        let feeds = self.feeds.load();
        let Some(feed) = feeds
            .get(&backend)
            .filter(|f| f.block_size.load(Relaxed) == block_size)
        else {
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
        endpoint: impl Fn(&Backend) -> Option<FeedEndpoints>,
    ) {
        let mut tasks = self.tasks.lock();
        let wanted: HashMap<ServerId, FeedEndpoints> = backends
            .iter()
            .filter_map(|b| Some((b.id, endpoint(b)?)))
            .collect();
        let mut feeds: HashMap<ServerId, Arc<FeedState>> = (**self.feeds.load()).clone();
        tasks.retain(|id, task| {
            let keep = wanted.get(id) == Some(&task.endpoints);
            if !keep {
                task.handle.abort();
                feeds.remove(id);
                self.forget_blocks(*id);
            }
            keep
        });
        for (id, endpoints) in wanted {
            if tasks.contains_key(&id) {
                continue;
            }
            let state = Arc::new(FeedState::default());
            let handle = tokio::spawn(follow(
                Arc::downgrade(self),
                id,
                endpoints.clone(),
                state.clone(),
            ))
            .abort_handle();
            feeds.insert(id, state);
            tasks.insert(id, Task { endpoints, handle });
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
        for (_, index) in self.indexes.load().iter() {
            index.clear(backend);
        }
        if let Some(feed) = self.feeds.load().get(&backend) {
            feed.credits.lock().clear();
        }
    }

    /// A (re)connected feed: its view starts over (forgetting what it knew when `forget`) and
    /// is trusted after the warm-up, or at once if the publisher's stream opens now.
    fn start_over(&self, backend: ServerId, state: &FeedState, forget: bool) {
        if forget {
            self.forget_blocks(backend);
        }
        self.warm_up(state);
        state.connected.store(true, Relaxed);
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
        let indexes = self.indexes.load();
        let blocks: usize = indexes.iter().map(|(_, i)| i.total_blocks()).sum();
        let bytes: usize = indexes.iter().map(|(_, i)| i.approx_bytes()).sum();
        self.metrics.blocks.set(blocks as i64);
        self.metrics.bytes.set(bytes as i64);
    }

    /// Applies one batch of `backend`'s events (`replayed`: an old batch asked for again, whose
    /// age is no lag).
    fn apply(&self, backend: ServerId, batch: &EventBatch, replayed: bool) -> bool {
        let m = &self.metrics;
        m.count("skipped", batch.skipped.len() as u64);
        let feeds = self.feeds.load();
        let Some(feed) = feeds.get(&backend) else {
            return false;
        };
        let mut cleared = false;
        for event in &batch.events {
            match event {
                KvEvent::Stored(s) if s.is_matchable() => {
                    let size = s.block_size;
                    let current = feed.block_size.load(Relaxed);
                    if current != size {
                        // The size is the backend's own, set by its first store (and again
                        // once it holds nothing: a restart, a cleared cache). A store of
                        // another size while it holds blocks is one that cannot apply.
                        let holds = self.index(current).map_or(0, |i| i.blocks(backend));
                        if holds > 0 {
                            self.store_failed(feed, "a block size other than the backend's");
                            continue;
                        }
                        feed.block_size.store(size, Relaxed);
                        feed.failed_stores.store(0, Relaxed);
                    }
                    let hashes: Vec<u64> = vllm_protocol::events::raw_hashes(&s.block_hashes);
                    let stored = self.index_or_new(size).stored(
                        backend,
                        s.parent.map(|p| p.0),
                        &hashes,
                        &s.token_ids,
                        size as usize,
                    );
                    match stored {
                        Ok(_) => {
                            feed.failed_stores.store(0, Relaxed);
                            m.count("stored", 1);
                        }
                        Err(e) => self.store_failed(feed, &e.to_string()),
                    }
                }
                KvEvent::Stored(_) => m.count("skipped", 1),
                KvEvent::Removed(r) if r.is_gpu() => {
                    let hashes: Vec<u64> = vllm_protocol::events::raw_hashes(&r.block_hashes);
                    let held = self
                        .index(feed.block_size.load(Relaxed))
                        .map_or(0, |i| i.removed(backend, &hashes));
                    m.count("removed", 1);
                    // Blocks stored before this feed listened, or whose store was skipped.
                    m.count("unknown_blocks", (hashes.len() - held) as u64);
                }
                KvEvent::Removed(_) => m.count("skipped", 1),
                KvEvent::AllCleared => {
                    self.forget_blocks(backend);
                    feed.failed_stores.store(0, Relaxed);
                    cleared = true;
                    m.count("cleared", 1);
                }
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        if batch.ts > 0.0 && !replayed {
            m.lag.observe((now - batch.ts).max(0.0));
        }
        cleared
    }

    /// A store that could not apply: counted, and after a run of them the feed is not used.
    fn store_failed(&self, feed: &FeedState, why: &str) {
        self.metrics.count("failed", 1);
        let failed = feed.failed_stores.fetch_add(1, Relaxed) + 1;
        if failed == MAX_FAILED_STORES {
            tracing::warn!(
                why,
                "KV events: a backend's stores keep failing; matching it by strings until one applies"
            );
        }
    }
}

/// What a message's sequence number says about the feed's view.
#[derive(Debug, PartialEq, Eq)]
enum Continuity {
    /// The message follows the last one (or opens a publisher's stream): nothing was missed.
    Follows,
    /// The publisher started again (sequence 0 after others): it has an empty cache.
    Restarted,
    /// The first message seen comes from the middle of the stream: what came before is unknown.
    Joined,
    /// Messages were lost.
    Gap,
    /// A message already applied (the replay that filled a gap brought it first).
    Behind,
    /// A number far behind the last one: not a replayed batch but a publisher that numbers
    /// anew (or a broken one). Its view starts over, as after a gap.
    Renumbered,
}

fn continuity(last: Option<u64>, seq: u64) -> Continuity {
    match last {
        None if seq == 0 => Continuity::Follows,
        None => Continuity::Joined,
        Some(prev) if Some(seq) == prev.checked_add(1) => Continuity::Follows,
        Some(_) if seq == 0 => Continuity::Restarted,
        Some(prev) if seq <= prev && prev - seq <= MAX_BEHIND => Continuity::Behind,
        Some(prev) if seq <= prev => Continuity::Renumbered,
        Some(_) => Continuity::Gap,
    }
}

/// One backend's feed: subscribes (again after a failure), applies batches, watches the
/// sequence numbers and the connection. Ends when the index is dropped or the feed aborted.
///
/// On every (re)connection the feed starts over: what the backend held is forgotten (events
/// may have been lost meanwhile, or the publisher restarted: after a disconnection nothing
/// tells one from the other) and it warms up, unless its first message opens a fresh
/// publisher's stream, or the replay socket still has everything from the first batch. While
/// the publisher is away the feed is down (the string index answers).
async fn follow(
    events: std::sync::Weak<KvEvents>,
    backend: ServerId,
    endpoints: FeedEndpoints,
    state: Arc<FeedState>,
) {
    let endpoint = endpoints.events.as_str();
    let limits = match events.upgrade() {
        Some(e) => e.frame_limits(),
        None => return,
    };
    // The first connection; later ones the subscriber makes itself (reported as such).
    let mut backoff = Duration::from_millis(200);
    let mut sub = loop {
        match Subscriber::connect(endpoint, limits, Duration::from_secs(2)).await {
            Ok(sub) => break sub,
            Err(e) => {
                tracing::debug!(endpoint, error = %e, "KV events: no publisher yet");
                if events.strong_count() == 0 {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    };
    // The last sequence number applied on this connection.
    let mut last: Option<u64> = None;
    {
        let Some(events) = events.upgrade() else {
            return;
        };
        events.start_over(backend, &state, false);
        if let Some(next) = events.fill_in(backend, &endpoints, 0).await {
            tracing::info!(
                endpoint,
                batches = next,
                "KV events: the publisher's whole stream was replayed; live at once"
            );
            state.state.store(LIVE, Relaxed);
            last = next.checked_sub(1);
        }
    }
    {
        loop {
            let received = sub.next().await;
            let Some(events) = events.upgrade() else {
                return;
            };
            let message = match received {
                Received::Message(Ok(m)) => m,
                Received::Message(Err(e)) => {
                    tracing::debug!(endpoint, error = %e, "KV events: an unreadable message");
                    events.metrics.count("skipped", 1);
                    continue;
                }
                Received::Refused(why) => {
                    tracing::warn!(endpoint, reason = %why, "KV events: the publisher sent what it must not; disconnected");
                    events.metrics.count("refused", 1);
                    continue;
                }
                Received::Disconnected => {
                    tracing::warn!(endpoint, "KV events: the publisher went away; the string index answers for this backend until it is back");
                    state.connected.store(false, Relaxed);
                    state.state.store(DOWN, Relaxed);
                    continue;
                }
                Received::Reconnected => {
                    tracing::info!(
                        endpoint,
                        "KV events: the publisher is back; re-learning the backend"
                    );
                    events.start_over(backend, &state, true);
                    last = None;
                    continue;
                }
            };
            match continuity(last, message.seq) {
                Continuity::Follows if last.is_none() => state.state.store(LIVE, Relaxed),
                Continuity::Follows => {}
                Continuity::Behind => {
                    events.metrics.count("behind", 1);
                    continue;
                }
                Continuity::Renumbered => {
                    tracing::warn!(
                        endpoint,
                        last = last.unwrap_or(0),
                        seq = message.seq,
                        "KV events: sequence numbers went far back; re-learning the backend"
                    );
                    events.metrics.gaps.inc();
                    events.forget_blocks(backend);
                    events.warm_up(&state);
                }
                Continuity::Restarted => {
                    tracing::info!(
                        endpoint,
                        "KV events: the publisher restarted (an empty cache)"
                    );
                    events.metrics.gaps.inc();
                    events.forget_blocks(backend);
                    state.state.store(LIVE, Relaxed);
                }
                Continuity::Joined => {
                    let next = events.fill_in(backend, &endpoints, 0).await;
                    if let Some(next) = next.filter(|next| message.seq <= *next) {
                        tracing::info!(
                            endpoint,
                            seq = message.seq,
                            "KV events: joined a running publisher; its whole stream was replayed"
                        );
                        state.state.store(LIVE, Relaxed);
                        last = next.checked_sub(1);
                        if message.seq < next {
                            continue;
                        }
                    } else {
                        tracing::info!(
                            endpoint,
                            seq = message.seq,
                            "KV events: joined a running publisher; warming up"
                        );
                    }
                }
                Continuity::Gap => {
                    let missed = last.map_or(0, |l| l.wrapping_add(1));
                    events.metrics.gaps.inc();
                    match events.fill_in(backend, &endpoints, missed).await {
                        Some(next) if next > missed && message.seq <= next => {
                            tracing::info!(
                                endpoint,
                                from = missed,
                                to = next,
                                "KV events: sequence gap filled in from the replay socket"
                            );
                            last = Some(next - 1);
                            if message.seq < next {
                                continue;
                            }
                        }
                        _ => {
                            tracing::warn!(
                                endpoint,
                                expected = missed,
                                got = message.seq,
                                "KV events: sequence gap; re-learning the backend"
                            );
                            events.forget_blocks(backend);
                            events.warm_up(&state);
                        }
                    }
                }
            }
            last = Some(message.seq);
            if events.apply(backend, &message.batch, false) {
                // An emptied cache is known exactly from here.
                state.state.store(LIVE, Relaxed);
            }
        }
    }
}

impl KvEvents {
    /// What one message from a publisher may take.
    fn frame_limits(&self) -> FrameLimits {
        FrameLimits {
            max_frame: self.settings.max_message,
            max_message: self.settings.max_message,
            ..FrameLimits::default()
        }
    }

    /// Asks `backend`'s replay socket for every batch from `from` on and applies them; the
    /// sequence number that follows the last one applied, or None when there is no replay
    /// socket or it no longer holds batch `from` (nothing is applied then).
    async fn fill_in(
        &self,
        backend: ServerId,
        endpoints: &FeedEndpoints,
        from: u64,
    ) -> Option<u64> {
        let replay = endpoints.replay.as_deref()?;
        match vllm_protocol::replay(replay, from, self.frame_limits(), REPLAY_TIMEOUT).await {
            Ok(Replayed::Filled(messages)) => {
                self.metrics.replayed("filled");
                let next = from.checked_add(messages.len() as u64)?;
                for message in &messages {
                    if self.apply(backend, &message.batch, true) {
                        if let Some(feed) = self.feeds.load().get(&backend) {
                            feed.state.store(LIVE, Relaxed);
                        }
                    }
                }
                Some(next)
            }
            Ok(Replayed::Lost { first }) => {
                self.metrics.replayed("lost");
                tracing::info!(
                    replay,
                    wanted = from,
                    first,
                    "KV events: the replay socket no longer holds what was missed"
                );
                None
            }
            Err(e) => {
                self.metrics.replayed("failed");
                tracing::warn!(replay, error = %e, "KV events: the replay failed");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::backend::BackendSpec;
    use vllm_protocol::{encode_batch, BlockRemoved, BlockStored, ExternalHash};
    use zeromq::{Socket, SocketSend, ZmqMessage};

    const BLOCK: usize = 4;

    /// A publisher on a loopback port, sending what the test tells it to; with a replay
    /// socket, it keeps what it sends (or pretends to send) for replay.
    struct Publisher {
        socket: zeromq::PubSocket,
        endpoint: String,
        replay: Option<(String, Arc<Mutex<vllm_protocol::ReplayBuffer>>)>,
    }

    impl Publisher {
        async fn bind(endpoint: &str) -> Self {
            let mut socket = zeromq::PubSocket::new();
            let endpoint = socket.bind(endpoint).await.unwrap().to_string();
            Self {
                socket,
                endpoint,
                replay: None,
            }
        }

        /// A publisher with a replay socket keeping its last `keep` batches.
        async fn with_replay(keep: usize) -> Self {
            let mut publisher = Self::bind("tcp://127.0.0.1:0").await;
            let mut router = zeromq::RouterSocket::new();
            let endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
            let buffer = Arc::new(Mutex::new(vllm_protocol::ReplayBuffer::new(keep)));
            tokio::spawn(vllm_protocol::replay::serve_replay(router, buffer.clone()));
            publisher.replay = Some((endpoint, buffer));
            publisher
        }

        fn endpoints(&self) -> FeedEndpoints {
            FeedEndpoints {
                events: self.endpoint.clone(),
                replay: self.replay.as_ref().map(|(e, _)| e.clone()),
            }
        }

        /// A batch published that no subscriber receives (lost on the way): only the replay
        /// buffer has it.
        fn lose(&mut self, seq: u64, events: Vec<KvEvent>) {
            let (_, buffer) = self.replay.as_ref().expect("a replay socket");
            buffer.lock().push(seq, encode(events).into());
        }

        async fn send_raw(&mut self, frames: Vec<Vec<u8>>) {
            let mut frames = frames.into_iter();
            let mut message = ZmqMessage::from(frames.next().unwrap());
            for f in frames {
                message.push_back(f.into());
            }
            self.socket.send(message).await.unwrap();
        }

        async fn send(&mut self, seq: u64, events: Vec<KvEvent>) {
            let payload = encode(events);
            if let Some((_, buffer)) = &self.replay {
                buffer.lock().push(seq, payload.clone().into());
            }
            self.send_raw(vec![b"kv".to_vec(), seq.to_be_bytes().to_vec(), payload])
                .await;
        }
    }

    fn encode(events: Vec<KvEvent>) -> Vec<u8> {
        encode_batch(&EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
            skipped: Vec::new(),
        })
    }

    /// `n` blocks of a prompt starting at `first` (external hashes first..first+n).
    fn stored(first: u64, parent: Option<u64>, tokens: &[u32]) -> KvEvent {
        let n = (tokens.len() / BLOCK) as u64;
        KvEvent::Stored(BlockStored {
            block_hashes: (first..first + n).map(ExternalHash).collect(),
            parent: parent.map(ExternalHash),
            token_ids: tokens.to_vec(),
            block_size: BLOCK as u32,
            lora: None,
            medium: Some("GPU".into()),
            extra_keys: false,
            group_idx: Some(0),
        })
    }

    fn removed(hashes: &[u64]) -> KvEvent {
        KvEvent::Removed(BlockRemoved {
            block_hashes: hashes.iter().copied().map(ExternalHash).collect(),
            medium: Some("GPU".into()),
            group_idx: Some(0),
        })
    }

    struct Feed {
        events: Arc<KvEvents>,
        backend: Vec<Arc<Backend>>,
        registry: Registry,
    }

    impl Feed {
        async fn follow(endpoint: &str, warmup: Duration, credit: Duration) -> Self {
            let endpoints = FeedEndpoints {
                events: endpoint.to_owned(),
                replay: None,
            };
            Self::follow_endpoints(endpoints, warmup, credit).await
        }

        async fn follow_endpoints(
            endpoints: FeedEndpoints,
            warmup: Duration,
            credit: Duration,
        ) -> Self {
            let feed = Self::start(endpoints, warmup, credit);
            feed.until(|f| f.connected()).await;
            feed
        }

        /// A feed following `endpoints`, not waiting for anything.
        fn start(endpoints: FeedEndpoints, warmup: Duration, credit: Duration) -> Self {
            let mut registry = Registry::default();
            let events = KvEvents::new(
                EventSettings {
                    warmup,
                    credit,
                    seed: 7,
                    max_message: 1 << 20,
                },
                &mut registry,
            );
            let backend = vec![Arc::new(
                Backend::new(BackendSpec::new("http://127.0.0.1:1"), 1000).unwrap(),
            )];
            events.sync(&backend, |_| Some(endpoints.clone()));
            Self {
                events,
                backend,
                registry,
            }
        }

        fn connected(&self) -> bool {
            self.events
                .feeds
                .load()
                .values()
                .all(|f| f.connected.load(Relaxed))
        }

        fn live(&self) -> bool {
            self.events.live(self.backend[0].id)
        }

        /// Tokens of `prompt` the backend holds by its events (None: not live).
        fn matched(&self, prompt: &[u32]) -> Option<u64> {
            self.events.matches(prompt, &self.backend).0[0]
        }

        /// Blocks the backend holds in the index of the tests' block size.
        fn blocks(&self) -> usize {
            self.events
                .index(BLOCK as u32)
                .map_or(0, |i| i.blocks(self.backend[0].id))
        }

        fn metric(&self, line_start: &str) -> f64 {
            self.events.observe();
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
            text.lines()
                .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
                .unwrap_or(0.0)
        }

        async fn until(&self, what: impl Fn(&Self) -> bool) {
            for _ in 0..500 {
                if what(self) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("the feed did not get there in 5 s");
        }
    }

    fn prompt(n_blocks: usize, salt: u32) -> Vec<u32> {
        (0..(n_blocks * BLOCK) as u32)
            .map(|t| t * 7 + salt)
            .collect()
    }

    #[tokio::test]
    async fn a_fresh_publisher_is_matched_from_its_events_and_evictions_count() {
        let mut publisher = Publisher::bind("tcp://127.0.0.1:0").await;
        let feed = Feed::follow(
            &publisher.endpoint,
            Duration::from_secs(3600),
            Duration::ZERO,
        )
        .await;
        assert!(!feed.live(), "nothing is trusted before the first message");
        let p = prompt(3, 0);
        publisher.send(0, vec![stored(10, None, &p)]).await;
        feed.until(|f| f.matched(&p).is_some()).await;
        // 3 blocks held; the last prompt token is always computed, so 2 blocks are usable.
        assert_eq!(feed.matched(&p), Some(2 * BLOCK as u64));
        let mut longer = p.clone();
        longer.extend(prompt(2, 1));
        assert_eq!(feed.matched(&longer), Some(3 * BLOCK as u64));
        publisher.send(1, vec![removed(&[11, 12])]).await;
        feed.until(|f| f.matched(&longer) == Some(BLOCK as u64))
            .await;
        assert_eq!(
            feed.metric("prefix_router_kv_events_total{kind=\"stored\"}"),
            1.0
        );
        assert_eq!(
            feed.metric("prefix_router_kv_events_total{kind=\"removed\"}"),
            1.0
        );
        assert_eq!(feed.metric("prefix_router_kv_blocks"), 1.0);
        assert_eq!(
            feed.metric("prefix_router_kv_event_feeds{state=\"live\"}"),
            1.0
        );
    }

    #[tokio::test]
    async fn bad_events_are_counted_and_change_nothing() {
        let mut publisher = Publisher::bind("tcp://127.0.0.1:0").await;
        let feed = Feed::follow(
            &publisher.endpoint,
            Duration::from_secs(3600),
            Duration::ZERO,
        )
        .await;
        let p = prompt(2, 0);
        publisher.send(0, vec![stored(10, None, &p)]).await;
        feed.until(|f| f.matched(&p).is_some()).await;
        let good = encode_batch(&EventBatch {
            ts: 0.0,
            events: vec![stored(20, None, &prompt(1, 9))],
            data_parallel_rank: None,
            skipped: Vec::new(),
        });
        // Not a message at all: two frames; a short sequence; truncated msgpack.
        publisher
            .send_raw(vec![b"kv".to_vec(), 1u64.to_be_bytes().to_vec()])
            .await;
        publisher
            .send_raw(vec![b"kv".to_vec(), vec![0, 1], good.clone()])
            .await;
        publisher
            .send_raw(vec![
                b"kv".to_vec(),
                1u64.to_be_bytes().to_vec(),
                good[..good.len() / 2].to_vec(),
            ])
            .await;
        // Events that cannot apply: a wrong block size, tokens that are not whole blocks, a
        // parent never stored, an offloading tier; removals of blocks never stored.
        let mut wrong_size = stored(30, None, &prompt(2, 3));
        if let KvEvent::Stored(s) = &mut wrong_size {
            s.block_size = 8;
            s.block_hashes.truncate(1);
        }
        let mut ragged = stored(40, None, &prompt(1, 4));
        if let KvEvent::Stored(s) = &mut ragged {
            s.token_ids.pop();
        }
        let mut cpu = stored(50, None, &prompt(1, 5));
        if let KvEvent::Stored(s) = &mut cpu {
            s.medium = Some("CPU".into());
        }
        publisher
            .send(
                1,
                vec![
                    wrong_size,
                    ragged,
                    stored(60, Some(999), &prompt(1, 6)),
                    cpu,
                    removed(&[777, 778]),
                ],
            )
            .await;
        // An unknown event type inside a good batch is skipped, the rest applies.
        let unknown = rmpv::Value::Array(vec![
            rmpv::Value::from(0.0),
            rmpv::Value::Array(vec![
                rmpv::Value::Map(vec![(
                    rmpv::Value::from("type"),
                    rmpv::Value::from("BlockTeleported"),
                )]),
                rmpv::Value::Array(vec![rmpv::Value::from("AllBlocksCleared")]),
            ]),
            rmpv::Value::Nil,
        ]);
        let mut payload = Vec::new();
        rmpv::encode::write_value(&mut payload, &unknown).unwrap();
        publisher
            .send_raw(vec![b"kv".to_vec(), 2u64.to_be_bytes().to_vec(), payload])
            .await;
        feed.until(|f| f.metric("prefix_router_kv_events_total{kind=\"cleared\"}") == 1.0)
            .await;
        // 3 unreadable messages, 1 store of an offloading tier, 1 unknown type.
        assert_eq!(
            feed.metric("prefix_router_kv_events_total{kind=\"skipped\"}"),
            5.0
        );
        // Stores that could not apply: another block size, a ragged one, an unknown parent.
        assert_eq!(
            feed.metric("prefix_router_kv_events_total{kind=\"failed\"}"),
            3.0
        );
        assert_eq!(
            feed.metric("prefix_router_kv_events_total{kind=\"unknown_blocks\"}"),
            2.0
        );
        assert_eq!(
            feed.metric("prefix_router_kv_event_gaps_total"),
            0.0,
            "unreadable messages are not gaps"
        );
        assert!(feed.live());
        assert_eq!(feed.matched(&p), Some(0), "the clear applied");
        assert_eq!(feed.metric("prefix_router_kv_blocks"), 0.0);
    }

    #[tokio::test]
    async fn a_gap_forgets_the_backend_until_it_is_relearned() {
        let mut publisher = Publisher::bind("tcp://127.0.0.1:0").await;
        let feed = Feed::follow(
            &publisher.endpoint,
            Duration::from_millis(300),
            Duration::ZERO,
        )
        .await;
        let p = prompt(3, 0);
        publisher.send(0, vec![stored(10, None, &p)]).await;
        feed.until(|f| f.matched(&p).is_some()).await;
        // Messages 1..4 lost: what they said is unknown, so nothing the backend held is trusted.
        let q = prompt(2, 1);
        publisher.send(5, vec![stored(20, None, &q)]).await;
        feed.until(|f| f.metric("prefix_router_kv_event_gaps_total") == 1.0)
            .await;
        assert!(!feed.live(), "warming up after the gap");
        assert_eq!(feed.blocks(), 2, "only what came after");
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(feed.live(), "live again after the warm-up");
        assert_eq!(feed.matched(&p), Some(0));
        assert_eq!(feed.matched(&q), Some(BLOCK as u64));
        // A restarted publisher (sequence 0 again) has an empty cache: live at once.
        publisher
            .send(0, vec![stored(30, None, &prompt(1, 2))])
            .await;
        feed.until(|f| f.metric("prefix_router_kv_event_gaps_total") == 2.0)
            .await;
        assert!(feed.live());
        assert_eq!(feed.matched(&q), Some(0));
    }

    #[tokio::test]
    async fn a_gap_is_filled_in_from_the_replay_socket() {
        let mut publisher = Publisher::with_replay(100).await;
        let feed = Feed::follow_endpoints(
            publisher.endpoints(),
            Duration::from_secs(3600),
            Duration::ZERO,
        )
        .await;
        let (p, q, r) = (prompt(3, 0), prompt(3, 1), prompt(3, 2));
        publisher.send(0, vec![stored(10, None, &p)]).await;
        feed.until(|f| f.live()).await;
        publisher.lose(1, vec![stored(20, None, &q), removed(&[12])]);
        publisher.send(2, vec![stored(30, None, &r)]).await;
        feed.until(|f| f.metric("prefix_router_kv_event_replays_total{outcome=\"filled\"}") == 1.0)
            .await;
        feed.until(|f| f.matched(&r).is_some_and(|m| m > 0)).await;
        assert!(feed.live(), "nothing was forgotten: no warm-up");
        assert_eq!(feed.metric("prefix_router_kv_event_gaps_total"), 1.0);
        assert_eq!(
            feed.matched(&q),
            Some(2 * BLOCK as u64),
            "the lost batch applied"
        );
        assert_eq!(
            feed.matched(&p),
            Some(2 * BLOCK as u64),
            "the lost removal applied, what came before kept"
        );
        assert_eq!(feed.blocks(), 8);
        // The stream goes on from where the replay ended.
        publisher.send(3, vec![removed(&[30, 31, 32])]).await;
        feed.until(|f| f.matched(&r) == Some(0)).await;
        assert_eq!(feed.metric("prefix_router_kv_event_gaps_total"), 1.0);
    }

    #[tokio::test]
    async fn a_gap_the_replay_socket_no_longer_holds_relearns_the_backend() {
        let mut publisher = Publisher::with_replay(2).await;
        let feed = Feed::follow_endpoints(
            publisher.endpoints(),
            Duration::from_secs(3600),
            Duration::ZERO,
        )
        .await;
        let p = prompt(3, 0);
        publisher.send(0, vec![stored(10, None, &p)]).await;
        feed.until(|f| f.live()).await;
        for seq in 1..4 {
            publisher.lose(
                seq,
                vec![stored(20 + 10 * seq, None, &prompt(1, seq as u32))],
            );
        }
        publisher
            .send(4, vec![stored(90, None, &prompt(2, 9))])
            .await;
        feed.until(|f| f.metric("prefix_router_kv_event_replays_total{outcome=\"lost\"}") == 1.0)
            .await;
        feed.until(|f| !f.live()).await;
        assert_eq!(feed.blocks(), 2, "only what came after the gap");
    }

    #[tokio::test]
    async fn joining_a_publisher_whose_replay_reaches_back_is_complete_at_once() {
        let mut publisher = Publisher::with_replay(100).await;
        // Published before the router listened.
        let p = prompt(3, 0);
        publisher.lose(0, vec![stored(10, None, &p)]);
        publisher.lose(1, vec![removed(&[12])]);
        let feed = Feed::follow_endpoints(
            publisher.endpoints(),
            Duration::from_secs(3600),
            Duration::ZERO,
        )
        .await;
        // Live without a message and without the warm-up: the replay brought everything.
        feed.until(|f| f.live()).await;
        assert_eq!(
            feed.metric("prefix_router_kv_event_replays_total{outcome=\"filled\"}"),
            1.0
        );
        assert_eq!(feed.matched(&p), Some(2 * BLOCK as u64), "from the replay");
        // The stream goes on (sent until the subscription has reached the publisher; a message
        // it missed meanwhile is a gap the replay fills in).
        let q = prompt(2, 1);
        let mut seq = 2;
        while feed.matched(&q) != Some(BLOCK as u64) {
            publisher
                .send(seq, vec![stored(20 + seq * 10, None, &q)])
                .await;
            seq += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(feed.live());
        assert_eq!(
            feed.metric("prefix_router_kv_event_replays_total{outcome=\"lost\"}"),
            0.0
        );
    }

    #[tokio::test]
    async fn a_publisher_that_goes_away_is_noticed_and_followed_again() {
        let mut publisher = Publisher::bind("tcp://127.0.0.1:0").await;
        let endpoint = publisher.endpoint.clone();
        let feed = Feed::follow(&endpoint, Duration::from_secs(3600), Duration::ZERO).await;
        let p = prompt(3, 0);
        publisher.send(0, vec![stored(10, None, &p)]).await;
        feed.until(|f| f.live()).await;
        drop(publisher);
        feed.until(|f| !f.live() && !f.connected()).await;
        assert_eq!(
            feed.metric("prefix_router_kv_event_feeds{state=\"down\"}"),
            1.0
        );
        // The server comes back on the same port with an empty cache.
        let mut publisher = Publisher::bind(&endpoint).await;
        feed.until(|f| f.connected()).await;
        assert!(
            !feed.live(),
            "not trusted before its first message says what it is"
        );
        // A subscriber may miss the first messages after (re)connecting (its subscription
        // reaches the publisher a moment later): the restarted server's first message again
        // until one lands.
        let q = prompt(3, 5);
        while !feed.live() {
            publisher.send(0, vec![stored(100, None, &q)]).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            feed.matched(&q),
            Some(2 * BLOCK as u64),
            "the new cache is followed"
        );
        assert_eq!(feed.matched(&p), Some(0), "the old cache was forgotten");
    }

    #[tokio::test]
    async fn a_running_publisher_is_trusted_after_the_warm_up() {
        let mut publisher = Publisher::bind("tcp://127.0.0.1:0").await;
        let feed = Feed::follow(
            &publisher.endpoint,
            Duration::from_millis(300),
            Duration::ZERO,
        )
        .await;
        // Silent, or heard from the middle of its stream: what it cached before is unknown.
        assert!(!feed.live());
        let p = prompt(3, 0);
        publisher.send(41, vec![stored(10, None, &p)]).await;
        feed.until(|f| f.metric("prefix_router_kv_events_total{kind=\"stored\"}") == 1.0)
            .await;
        assert!(!feed.live(), "still warming up");
        feed.until(|f| f.live()).await;
        assert_eq!(
            feed.matched(&p),
            Some(2 * BLOCK as u64),
            "what it said meanwhile counts"
        );
        assert_eq!(feed.metric("prefix_router_kv_event_gaps_total"), 0.0);
    }

    #[tokio::test]
    async fn a_routed_request_counts_as_held_until_its_credit_expires() {
        let mut publisher = Publisher::bind("tcp://127.0.0.1:0").await;
        let feed = Feed::follow(
            &publisher.endpoint,
            Duration::from_secs(3600),
            Duration::from_millis(200),
        )
        .await;
        publisher
            .send(0, vec![stored(10, None, &prompt(1, 9))])
            .await;
        feed.until(|f| f.live()).await;
        let p = prompt(4, 0);
        assert_eq!(feed.matched(&p), Some(0));
        let (_, names) = feed.events.matches(&p, &feed.backend);
        feed.events.credit(feed.backend[0].id, &names);
        assert_eq!(feed.matched(&p), Some(3 * BLOCK as u64));
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(feed.matched(&p), Some(0));
    }

    /// Two backends with different block sizes (two models, two vLLM settings) are each
    /// matched under their own; a backend whose block size is not known yet, or whose stores
    /// keep failing, is left to the string index (None), not answered 0.
    #[tokio::test]
    async fn each_backend_is_matched_under_its_own_block_size() {
        let mut small = Publisher::bind("tcp://127.0.0.1:0").await;
        let mut large = Publisher::bind("tcp://127.0.0.1:0").await;
        let mut registry = Registry::default();
        let events = KvEvents::new(
            EventSettings {
                warmup: Duration::from_secs(3600),
                credit: Duration::ZERO,
                seed: 7,
                max_message: 1 << 20,
            },
            &mut registry,
        );
        let backends: Vec<Arc<Backend>> = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
            .iter()
            .map(|u| Arc::new(Backend::new(BackendSpec::new(u), 1000).unwrap()))
            .collect();
        let endpoints = [small.endpoint.clone(), large.endpoint.clone()];
        events.sync(&backends, |b| {
            let i = backends.iter().position(|x| x.id == b.id)?;
            Some(FeedEndpoints {
                events: endpoints[i].clone(),
                replay: None,
            })
        });
        let p: Vec<u32> = (0..64).collect();
        let stored_sized = |first: u64, size: usize, tokens: &[u32]| {
            KvEvent::Stored(BlockStored {
                block_hashes: (first..first + (tokens.len() / size) as u64)
                    .map(ExternalHash)
                    .collect(),
                parent: None,
                token_ids: tokens.to_vec(),
                block_size: size as u32,
                lora: None,
                medium: Some("GPU".into()),
                extra_keys: false,
                group_idx: Some(0),
            })
        };
        async fn wait(what: impl Fn() -> bool) {
            for _ in 0..500 {
                if what() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("not reached in 5 s");
        }
        // Only the first has stored anything: the second has no block size yet.
        while events.matches(&p, &backends).0[0].is_none() {
            small.send(0, vec![stored_sized(10, 4, &p[..32])]).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(events.matches(&p, &backends).0, vec![Some(32), None]);
        while events.matches(&p, &backends).0[1].is_none() {
            large.send(0, vec![stored_sized(90, 16, &p[..48])]).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (held, names) = events.matches(&p, &backends);
        assert_eq!(held, vec![Some(32), Some(48)]);
        assert_eq!(names.sized(4).map(|n| n.len()), Some(16));
        assert_eq!(names.sized(16).map(|n| n.len()), Some(4));
        // The large one's stores start failing (parents it never reported): after a run of
        // them its index is not trusted.
        for seq in 1..=MAX_FAILED_STORES as u64 {
            let mut orphan = stored_sized(1000 + seq, 16, &p[..16]);
            if let KvEvent::Stored(s) = &mut orphan {
                s.parent = Some(ExternalHash(5));
            }
            large.send(seq, vec![orphan]).await;
        }
        wait(|| events.matches(&p, &backends).0[1].is_none()).await;
        assert!(!events.live(backends[1].id));
        assert_eq!(events.matches(&p, &backends).0[0], Some(32));
        // One store that applies brings it back.
        large
            .send(
                MAX_FAILED_STORES as u64 + 1,
                vec![stored_sized(3000, 16, &p[..16])],
            )
            .await;
        wait(|| events.matches(&p, &backends).0[1].is_some()).await;
    }

    /// A batch numbered 2^64 - 1 is no reason to drop every batch after it as one already seen:
    /// the feed starts over and applies what follows.
    #[tokio::test]
    async fn a_huge_sequence_number_does_not_silence_the_feed() {
        let mut publisher = Publisher::bind("tcp://127.0.0.1:0").await;
        let feed = Feed::follow(
            &publisher.endpoint,
            Duration::from_millis(200),
            Duration::ZERO,
        )
        .await;
        let p = prompt(3, 0);
        publisher.send(0, vec![stored(10, None, &p)]).await;
        feed.until(|f| f.live()).await;
        publisher.send(u64::MAX, vec![]).await;
        for seq in 1..=10u64 {
            publisher
                .send(seq, vec![stored(100 * seq, None, &prompt(1, seq as u32))])
                .await;
        }
        feed.until(|f| f.metric("prefix_router_kv_events_total{kind=\"stored\"}") == 11.0)
            .await;
        assert_eq!(
            feed.metric("prefix_router_kv_events_total{kind=\"behind\"}"),
            0.0
        );
        feed.until(|f| f.live()).await;
        assert_eq!(
            feed.matched(&prompt(1, 10)),
            Some(0),
            "one block: the last token is computed"
        );
        assert_eq!(feed.blocks(), 10, "what came after the renumbering");
    }

    /// A publisher that declares a frame of 2^50 bytes is disconnected and counted; nothing of
    /// it is buffered and the feed goes on trying (the process lives).
    #[tokio::test]
    async fn a_publisher_declaring_a_huge_frame_is_refused() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut greeting = [0u8; 64];
                    greeting[0] = 0xFF;
                    greeting[9] = 0x7F;
                    greeting[10] = 3;
                    greeting[11] = 1;
                    greeting[12..16].copy_from_slice(b"NULL");
                    let _ = stream.write_all(&greeting).await;
                    let ready = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
                    let _ = stream.write_all(&[0x04, ready.len() as u8]).await;
                    let _ = stream.write_all(ready).await;
                    let mut huge = vec![0x02u8];
                    huge.extend_from_slice(&(1u64 << 50).to_be_bytes());
                    let _ = stream.write_all(&huge).await;
                    tokio::time::sleep(Duration::from_secs(30)).await;
                });
            }
        });
        let endpoints = FeedEndpoints {
            events: endpoint,
            replay: None,
        };
        let feed = Feed::start(endpoints, Duration::ZERO, Duration::ZERO);
        feed.until(|f| f.metric("prefix_router_kv_events_total{kind=\"refused\"}") >= 1.0)
            .await;
        assert!(!feed.live());
    }
}
