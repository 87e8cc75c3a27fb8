//! The contract every prefix store keeps: memory, SQL and remote stores sit behind it.

use async_trait::async_trait;

use crate::{PrefixHashes, Tick};

/// A server (a vLLM backend) as the store knows it: an opaque, stable 64-bit id.
pub type ServerId = u64;

/// Default per-server capacity in entries (one entry = one prefix chunk on one server).
pub const DEFAULT_CAPACITY: u64 = 16_384;

/// The largest capacity a server may have: depths up to this fit the stores' packed keys.
pub const MAX_CAPACITY: u64 = (1 << 22) - 1;

/// What a notify did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NotifyOutcome {
    /// Chunks of the request.
    pub chunks: u64,
    /// Entries that were absent before this notify.
    pub inserted: u64,
    /// Entries removed to get back within capacity (may include some just inserted).
    pub evicted: u64,
}

/// The answer to a query.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueryOutcome {
    /// The candidate with the most leading chunks; ties go to the earliest in the given order.
    pub best: ServerId,
    /// Leading chunks `best` holds.
    pub matched: u64,
    /// Chunks of the request.
    pub total: u64,
    /// Leading chunks held by each candidate, in the order the candidates were given.
    pub matches: Vec<u64>,
}

impl QueryOutcome {
    /// Builds the outcome from per-candidate matches, picking the first maximum.
    pub fn from_matches(candidates: &[ServerId], matches: Vec<u64>, total: u64) -> Self {
        let mut best = 0;
        for (i, &m) in matches.iter().enumerate() {
            if m > matches[best] {
                best = i;
            }
        }
        Self {
            best: candidates.get(best).copied().unwrap_or_default(),
            matched: matches.get(best).copied().unwrap_or_default(),
            total,
            matches,
        }
    }
}

/// One server's place in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    pub server_id: ServerId,
    /// Entries it holds now (expired but not yet purged ones included).
    pub entries: u64,
    pub capacity: u64,
}

/// Settings shared by every store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    /// Capacity of a server that was never given one.
    pub default_capacity: u64,
    /// Entries not used for this many milliseconds are invisible to query.
    pub ttl_ms: Option<u64>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            default_capacity: DEFAULT_CAPACITY,
            ttl_ms: None,
        }
    }
}

impl StoreConfig {
    /// Checks the settings a store is opened with.
    pub fn validate(&self) -> Result<(), StoreError> {
        check_capacity(self.default_capacity)
    }
}

/// Rejects capacities the stores cannot represent.
pub fn check_capacity(capacity: u64) -> Result<(), StoreError> {
    if capacity > MAX_CAPACITY {
        return Err(StoreError::InvalidArgument(format!(
            "capacity {capacity} exceeds the maximum of {MAX_CAPACITY} entries per server"
        )));
    }
    Ok(())
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The caller asked for something the contract forbids (no candidates, capacity too big).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The backing service (database, remote index) could not be reached or failed.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The backing service did not answer in time.
    #[error("store timed out after {0} ms")]
    Timeout(u64),
    /// The backing data is not what this version understands (foreign or newer schema).
    #[error("incompatible store: {0}")]
    Incompatible(String),
}

/// A prefix index: for each server, which request prefixes it recently served.
///
/// Semantics (exact, and checked against [`crate::reference::ReferenceStore`]):
/// - `notify` inserts or refreshes every prefix with `last_used = max(old, t)`, then evicts the
///   least recently used entries, deepest first among equal `last_used` (then lowest hash), until
///   the server is within capacity. Each server's set therefore stays prefix-closed.
/// - `query` returns, per candidate, the largest `m` such that prefixes `1..=m` are all present
///   (and, with a TTL, used within it). It never changes state.
///
/// Async because SQL and remote stores do I/O; the memory store answers without awaiting.
#[async_trait]
pub trait PrefixStore: Send + Sync + 'static {
    /// Records that the request was sent to `server` at `t`.
    async fn notify(
        &self,
        hashes: &PrefixHashes,
        server: ServerId,
        t: Tick,
    ) -> Result<NotifyOutcome, StoreError>;

    /// Finds the candidate holding the longest prefix of the request. `candidates` must not be
    /// empty; callers order them by load so that ties go to the least loaded.
    async fn query(
        &self,
        hashes: &PrefixHashes,
        candidates: &[ServerId],
        t: Tick,
    ) -> Result<QueryOutcome, StoreError>;

    /// Forgets a server: all its entries and its capacity. Returns the entries removed.
    async fn drop_server(&self, server: ServerId) -> Result<u64, StoreError>;

    /// Sets a server's capacity, evicting down to it at once. Returns the entries evicted.
    async fn set_capacity(&self, server: ServerId, capacity: u64) -> Result<u64, StoreError>;

    /// Every known server, ordered by id.
    async fn servers(&self) -> Result<Vec<ServerInfo>, StoreError>;

    /// Removes entries that the TTL already hides from query, to free memory. Returns how many.
    async fn purge_expired(&self, now: Tick) -> Result<u64, StoreError>;

    /// A short name for logs and metrics ("memory", "sqlite", ...).
    fn kind(&self) -> &'static str;

    /// The in-memory store behind this one, if it is one: router replicas exchange its
    /// snapshots ([`crate::MemoryStore::export`], [`crate::MemoryStore::merge`]).
    fn as_memory(&self) -> Option<&crate::MemoryStore> {
        None
    }
}

/// Rejects a query without candidates, which has no answer.
pub fn check_candidates(candidates: &[ServerId]) -> Result<(), StoreError> {
    if candidates.is_empty() {
        return Err(StoreError::InvalidArgument(
            "query needs at least one candidate server".into(),
        ));
    }
    Ok(())
}
