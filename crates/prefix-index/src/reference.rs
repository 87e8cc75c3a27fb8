//! The reference model: the store semantics written as plainly as possible, for tests.
//!
//! Every store is checked against it operation by operation (see `tests/`). It is slow on
//! purpose (eviction scans all of a server's entries) and must stay obviously right.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};

use async_trait::async_trait;
use parking_lot::Mutex;

use crate::store::{check_candidates, check_capacity};
use crate::{
    NotifyOutcome, PrefixHashes, PrefixStore, QueryOutcome, ServerId, ServerInfo, StoreConfig,
    StoreError, Tick,
};

#[derive(Clone, Copy, Debug)]
struct Entry {
    last_used: Tick,
    depth: u64,
}

#[derive(Debug, Default)]
struct Server {
    capacity: u64,
    /// prefix hash -> entry
    entries: HashMap<u64, Entry>,
}

/// A plain map of prefix -> (last_used, depth) per server.
#[derive(Debug, Default)]
pub struct ReferenceStore {
    config: StoreConfig,
    servers: Mutex<BTreeMap<ServerId, Server>>,
}

impl ReferenceStore {
    pub fn new(config: StoreConfig) -> Self {
        Self {
            config,
            servers: Mutex::default(),
        }
    }

    fn visible(&self, e: &Entry, t: Tick) -> bool {
        self.config
            .ttl_ms
            .is_none_or(|ttl| e.last_used >= t.ttl_cutoff(ttl))
    }

    /// Evicts the least recently used entry, deepest first among equal `last_used`, then the
    /// lowest hash, until the server is within capacity.
    fn evict_to_capacity(server: &mut Server) -> u64 {
        let mut evicted = 0;
        while server.entries.len() as u64 > server.capacity {
            let victim = *server
                .entries
                .iter()
                .min_by_key(|(h, e)| (e.last_used, Reverse(e.depth), **h))
                .map(|(h, _)| h)
                .expect("a server over capacity has entries");
            server.entries.remove(&victim);
            evicted += 1;
        }
        evicted
    }
}

#[async_trait]
impl PrefixStore for ReferenceStore {
    async fn notify(
        &self,
        hashes: &PrefixHashes,
        server: ServerId,
        t: Tick,
    ) -> Result<NotifyOutcome, StoreError> {
        let mut servers = self.servers.lock();
        let s = servers.entry(server).or_insert_with(|| Server {
            capacity: self.config.default_capacity,
            entries: HashMap::new(),
        });
        let mut inserted = 0;
        for (i, &h) in hashes.as_slice().iter().enumerate() {
            match s.entries.get_mut(&h) {
                Some(e) => e.last_used = e.last_used.max(t),
                None => {
                    s.entries.insert(
                        h,
                        Entry {
                            last_used: t,
                            depth: i as u64 + 1,
                        },
                    );
                    inserted += 1;
                }
            }
        }
        let evicted = Self::evict_to_capacity(s);
        Ok(NotifyOutcome {
            chunks: hashes.len() as u64,
            inserted,
            evicted,
        })
    }

    async fn query(
        &self,
        hashes: &PrefixHashes,
        candidates: &[ServerId],
        t: Tick,
    ) -> Result<QueryOutcome, StoreError> {
        check_candidates(candidates)?;
        let servers = self.servers.lock();
        let matches = candidates
            .iter()
            .map(|id| {
                let Some(s) = servers.get(id) else { return 0 };
                hashes
                    .as_slice()
                    .iter()
                    .take_while(|h| s.entries.get(h).is_some_and(|e| self.visible(e, t)))
                    .count() as u64
            })
            .collect();
        Ok(QueryOutcome::from_matches(
            candidates,
            matches,
            hashes.len() as u64,
        ))
    }

    async fn drop_server(&self, server: ServerId) -> Result<u64, StoreError> {
        let removed = self.servers.lock().remove(&server);
        Ok(removed.map_or(0, |s| s.entries.len() as u64))
    }

    async fn set_capacity(&self, server: ServerId, capacity: u64) -> Result<u64, StoreError> {
        check_capacity(capacity)?;
        let mut servers = self.servers.lock();
        let s = servers.entry(server).or_default();
        s.capacity = capacity;
        Ok(Self::evict_to_capacity(s))
    }

    async fn servers(&self) -> Result<Vec<ServerInfo>, StoreError> {
        Ok(self
            .servers
            .lock()
            .iter()
            .map(|(&server_id, s)| ServerInfo {
                server_id,
                entries: s.entries.len() as u64,
                capacity: s.capacity,
            })
            .collect())
    }

    async fn purge_expired(&self, now: Tick) -> Result<u64, StoreError> {
        let Some(ttl) = self.config.ttl_ms else {
            return Ok(0);
        };
        let cutoff = now.ttl_cutoff(ttl);
        let mut purged = 0;
        for s in self.servers.lock().values_mut() {
            let before = s.entries.len();
            s.entries.retain(|_, e| e.last_used >= cutoff);
            purged += (before - s.entries.len()) as u64;
        }
        Ok(purged)
    }

    fn kind(&self) -> &'static str {
        "reference"
    }
}
