//! Where matches come from: "how many leading tokens of this request does each candidate
//! hold". The string index (a prefix store over the request string's chunks) is the first
//! source; the token-block index fed by KV events will be the second. Policies see only the
//! answer, in tokens.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prefix_index::{now_secs, PrefixHasher, PrefixHashes, PrefixStore, ServerId, Tick};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::backend::Backend;

/// What of a request the string index matches: the chained hashes of its request string's
/// chunks, and the string's length.
#[derive(Clone, Debug)]
pub struct PromptKey {
    pub chunks: PrefixHashes,
    pub text_bytes: u64,
}

/// Leading tokens each candidate holds, in the candidates' order, and the request's tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Matches {
    pub held_tokens: Vec<u64>,
    pub total_tokens: u64,
}

/// The source could not answer in time: the request is routed by load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unavailable;

/// A source of matches.
#[async_trait::async_trait]
pub trait MatchSource: Send + Sync {
    /// A short name for logs and metrics.
    fn kind(&self) -> &'static str;
    /// What each of `candidates` holds of the request.
    async fn matches(
        &self,
        key: &PromptKey,
        candidates: &[Arc<Backend>],
    ) -> Result<Matches, Unavailable>;
    /// The request went to `backend` (whatever becomes of it: vLLM keeps the prefill even of a
    /// failed request).
    async fn sent(&self, key: &PromptKey, backend: &Arc<Backend>);
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

/// The string index's own metrics.
struct IndexMetrics {
    errors: Family<OpLabels, Counter>,
    latency: Family<OpLabels, Histogram, fn() -> Histogram>,
}

fn latency() -> Histogram {
    // 10 µs .. ~42 s
    Histogram::new(exponential_buckets(1e-5, 2.0, 23))
}

/// The string index: a [`PrefixStore`] (memory, SQLite, PostgreSQL or a remote `index`) over
/// the request strings' chunks. Store calls wait at most `timeout`; a failing store makes
/// requests route by load, counted and logged once per outage.
pub struct StringIndex {
    pub store: Arc<dyn PrefixStore>,
    pub hasher: PrefixHasher,
    timeout: Duration,
    /// Notify on the request path (a memory store answers in microseconds) or in the
    /// background (a database or a remote index).
    inline_notify: bool,
    /// Set while the store fails, so an outage is logged once, not per request.
    down: AtomicBool,
    metrics: IndexMetrics,
}

impl StringIndex {
    /// The index over `store`, registering its metrics in `registry`.
    pub fn new(
        store: Arc<dyn PrefixStore>,
        hasher: PrefixHasher,
        timeout: Duration,
        inline_notify: bool,
        registry: &mut Registry,
    ) -> Self {
        let metrics = IndexMetrics {
            errors: Family::default(),
            latency: Family::new_with_constructor(latency),
        };
        registry.register(
            "prefix_router_store_errors",
            "Prefix store operations that failed or timed out (routing fell back to load)",
            metrics.errors.clone(),
        );
        registry.register(
            "prefix_router_store_latency_seconds",
            "Prefix store operation latency",
            metrics.latency.clone(),
        );
        // Zero before the first failure, so that rates and alerts have a series to work on.
        for op in ["query", "notify"] {
            drop(metrics.errors.get_or_create(&OpLabels { op }));
        }
        Self {
            store,
            hasher,
            timeout,
            inline_notify,
            down: AtomicBool::new(false),
            metrics,
        }
    }

    /// The key of a request string.
    pub fn key(&self, text: &str) -> PromptKey {
        PromptKey {
            chunks: self.hasher.hash(text.as_bytes()),
            text_bytes: text.len() as u64,
        }
    }

    fn ok(&self) {
        if self.down.swap(false, Relaxed) {
            tracing::info!(
                store = self.store.kind(),
                "the prefix store answers again: prefix routing resumes"
            );
        }
    }

    fn failed(&self, op: &'static str, error: &str) {
        self.metrics.errors.get_or_create(&OpLabels { op }).inc();
        if !self.down.swap(true, Relaxed) {
            tracing::warn!(
                store = self.store.kind(),
                op,
                error,
                "the prefix store failed: routing by load until it answers"
            );
        }
    }

    fn observe(&self, op: &'static str, start: Instant) {
        self.metrics
            .latency
            .get_or_create(&OpLabels { op })
            .observe(start.elapsed().as_secs_f64());
    }

    /// Tokens that `chunks` chunks of request string stand for at a backend with this many
    /// bytes per token.
    fn tokens(&self, chunks: u64, bytes_per_token: f64) -> u64 {
        (chunks as f64 * self.hasher.chunk_size() as f64 / bytes_per_token).round() as u64
    }

    async fn notify(&self, key: &PromptKey, backend: &Backend) {
        self.notify_at(&key.chunks, backend, Tick::from_secs(now_secs()))
            .await
    }

    /// Another router replica sent a request of these chunks to `backend` at `t` (told over
    /// the replica bus, which needs the memory store): applied at once, without the timeout
    /// and latency bookkeeping of a request's own notify.
    pub fn notify_from_peer(&self, chunks: &PrefixHashes, backend: &Backend, t: Tick) {
        let Some(memory) = self.store.as_memory() else {
            return;
        };
        match memory.notify_now(chunks, backend.id, t) {
            Ok(out) => self.count_entries(backend, out),
            Err(e) => self.failed("notify", &e.to_string()),
        }
    }

    fn count_entries(&self, backend: &Backend, out: prefix_index::NotifyOutcome) {
        let entries = &backend.entries;
        let now = entries.load(Relaxed);
        entries.store((now + out.inserted).saturating_sub(out.evicted), Relaxed);
    }

    async fn notify_at(&self, chunks: &PrefixHashes, backend: &Backend, t: Tick) {
        let start = Instant::now();
        let result =
            tokio::time::timeout(self.timeout, self.store.notify(chunks, backend.id, t)).await;
        self.observe("notify", start);
        match result {
            Ok(Ok(out)) => {
                self.ok();
                self.count_entries(backend, out);
            }
            Ok(Err(e)) => self.failed("notify", &e.to_string()),
            Err(_) => self.failed("notify", "timed out"),
        }
    }
}

#[async_trait::async_trait]
impl MatchSource for Arc<StringIndex> {
    fn kind(&self) -> &'static str {
        "strings"
    }

    async fn matches(
        &self,
        key: &PromptKey,
        candidates: &[Arc<Backend>],
    ) -> Result<Matches, Unavailable> {
        let ids: Vec<ServerId> = candidates.iter().map(|b| b.id).collect();
        let start = Instant::now();
        let t = Tick::from_secs(now_secs());
        let result =
            tokio::time::timeout(self.timeout, self.store.query(&key.chunks, &ids, t)).await;
        self.observe("query", start);
        let q = match result {
            Ok(Ok(q)) => {
                self.ok();
                q
            }
            Ok(Err(e)) => {
                self.failed("query", &e.to_string());
                return Err(Unavailable);
            }
            Err(_) => {
                self.failed("query", "timed out");
                return Err(Unavailable);
            }
        };
        // One conversion for all candidates: a chunk is the same text wherever it is held, so
        // equal chunk matches stay equal (ties go to the least loaded, not to whichever
        // backend's learned bytes per token happens to be lower).
        let bytes_per_token = candidates.iter().map(|b| b.bytes_per_token()).sum::<f64>()
            / candidates.len().max(1) as f64;
        Ok(Matches {
            held_tokens: q
                .matches
                .iter()
                .map(|&m| self.tokens(m, bytes_per_token))
                .collect(),
            total_tokens: self.tokens(q.total, bytes_per_token),
        })
    }

    async fn sent(&self, key: &PromptKey, backend: &Arc<Backend>) {
        if self.inline_notify {
            self.notify(key, backend).await
        } else {
            let (index, key, backend) = (self.clone(), key.clone(), backend.clone());
            tokio::spawn(async move { index.notify(&key, &backend).await });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::backend::BackendSpec;
    use prefix_index::{MemoryStore, StoreConfig};

    #[tokio::test]
    async fn equal_chunk_matches_stay_equal_whatever_each_backend_learned() {
        let store = Arc::new(MemoryStore::new(StoreConfig::default()).unwrap());
        let index = Arc::new(StringIndex::new(
            store,
            PrefixHasher::default(),
            Duration::from_secs(1),
            true,
            &mut Registry::default(),
        ));
        let backend = |url: &str, bytes: u64| {
            let b = Arc::new(Backend::new(BackendSpec::new(url), 100).unwrap());
            b.observe_prompt(bytes, 10_000);
            b
        };
        // 3.9 and 4.1 bytes per token learned: the same chunks must still weigh the same, so
        // that ties go to the least loaded.
        let (a, b) = (backend("http://a:1", 39_000), backend("http://b:1", 41_000));
        let key = index.key(&"x".repeat(1280));
        index.sent(&key, &a).await;
        index.sent(&key, &b).await;
        let m = index.matches(&key, &[a, b]).await.unwrap();
        assert_eq!(m.held_tokens[0], m.held_tokens[1]);
        assert_eq!(m.held_tokens[0], m.total_tokens);
        assert_eq!(
            m.total_tokens, 320,
            "10 chunks of 128 bytes at 4 bytes a token"
        );
    }
}
