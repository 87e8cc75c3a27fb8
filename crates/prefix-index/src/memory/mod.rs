//! The in-memory store: the default, and the fastest.
//!
//! Layout (why it is fast and small):
//! - The index is `prefix hash -> holders`, split into shards by the top bits that every prefix
//!   of a request shares (see [`crate::hashing::SHARD_BITS`]). A query takes one shard's read
//!   lock and walks the request's chain: O(chunks), whatever the number of servers or entries.
//! - A holder is a [`Stamp`]: the server's slot and the entry's `last_used`, packed in 63 bits, so
//!   a prefix held by one server costs one `u64` beside its key. Prefixes held by several servers
//!   point into a per-shard list of stamps.
//! - Each server keeps its eviction order ([`lru`]) under its own mutex: entries grouped by
//!   `last_used` in a B-tree, so eviction is O(log n), and an entry's hash finds its shard.
//!
//! Locks: a notify holds its server's mutex and takes one shard lock at a time; a query takes
//! one shard read lock. No operation holds two shard locks, and none takes the registry writer
//! lock while holding a server's mutex.

mod lru;
mod shard;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};

use crate::hashing::{shard_of, SHARD_BITS};
use crate::store::{check_candidates, check_capacity};
use crate::{
    NotifyOutcome, PrefixHashes, PrefixStore, QueryOutcome, ServerId, ServerInfo, StoreConfig,
    StoreError, Tick,
};
use lru::{Lru, LruEntry};
use shard::Shard;
pub use shard::MAX_SERVERS;

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

const SHARDS: usize = 1 << SHARD_BITS;

/// Aligned so that neighbouring shard locks do not share a cache line.
#[repr(align(128))]
#[derive(Default)]
struct PaddedShard(RwLock<Shard>);

/// A server's eviction state, under its own mutex.
struct ServerState {
    lru: Lru,
    /// Set when the server was dropped; a notify that raced with the drop starts over.
    dropped: bool,
}

struct ServerNode {
    slot: u32,
    state: Mutex<ServerState>,
}

/// id -> server, replaced whole on the rare registration or drop so readers never lock.
#[derive(Default, Clone)]
struct Registry {
    servers: FastMap<ServerId, Arc<ServerNode>>,
    /// slot -> id of the server in it.
    ids: Vec<Option<ServerId>>,
}

#[derive(Default)]
struct SlotAllocator {
    next: u32,
    free: Vec<u32>,
}

/// Per-thread buffers, so that a query or notify allocates nothing but its answer.
#[derive(Default)]
struct Scratch {
    /// Matched chunks, by slot (valid for the running query's holders).
    progress: Vec<u32>,
    /// Per slot: holds the prefix being probed (false between probes).
    marks: Vec<bool>,
    /// Slots holding the first chunk of the running query.
    holders: Vec<u32>,
    /// (server id, matched chunks) of the touched slots.
    matched: Vec<(ServerId, u32)>,
    old_ticks: Vec<Option<Tick>>,
    moved: Vec<(u64, LruEntry)>,
    touched: Vec<LruEntry>,
    victims: Vec<u64>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// Files an entry just upserted at `t` for the eviction order, by the `last_used` it had
/// (`old`): a new one or an older one is touched at `t` (an older one also leaves its old
/// group), a newer one stays where it is. Returns whether it is new.
fn restamp(
    old: Option<Tick>,
    t: Tick,
    entry: LruEntry,
    moved: &mut Vec<(u64, LruEntry)>,
    touched: &mut Vec<LruEntry>,
) -> bool {
    match old {
        None => {}
        Some(old) if old < t => moved.push((old.millis(), entry)),
        Some(_) => return false,
    }
    touched.push(entry);
    old.is_none()
}

/// Finds how deep each server's hold on a request goes, bisecting all servers at once.
///
/// A server's set is prefix-closed, and a prefix's `last_used` is never older than its
/// extensions', so "holds prefix d (visible under the TTL)" is true up to the match length and
/// false after it. One probe splits the servers into those whose match reaches the probed depth
/// and the rest: O(distinct match lengths × log chunks) probes instead of one per chunk.
struct Bisection<'a> {
    shard: &'a Shard,
    hashes: &'a [u64],
    cutoff: Tick,
}

impl Bisection<'_> {
    /// Every slot in `slots` holds prefix `lo`; writes to `answers[slot]` its deepest prefix in
    /// `lo..=hi`. Reorders `slots`; leaves `marks` all false.
    fn run(
        &self,
        lo: usize,
        hi: usize,
        slots: &mut [u32],
        marks: &mut [bool],
        answers: &mut [u32],
    ) {
        if slots.is_empty() {
            return;
        }
        if lo == hi {
            for &slot in slots.iter() {
                answers[slot as usize] = lo as u32;
            }
            return;
        }
        let mid = lo + (hi - lo).div_ceil(2);
        let probed = self.shard.holders(self.hashes[mid - 1]);
        for stamp in probed.iter().filter(|s| s.tick() >= self.cutoff) {
            if let Some(mark) = marks.get_mut(stamp.slot() as usize) {
                *mark = true;
            }
        }
        let mut deeper = 0;
        for i in 0..slots.len() {
            if marks[slots[i] as usize] {
                slots.swap(i, deeper);
                deeper += 1;
            }
        }
        for stamp in probed {
            if let Some(mark) = marks.get_mut(stamp.slot() as usize) {
                *mark = false;
            }
        }
        let (reach, stop_short) = slots.split_at_mut(deeper);
        self.run(mid, hi, reach, marks, answers);
        self.run(lo, mid - 1, stop_short, marks, answers);
    }
}

/// One server as [`MemoryStore::export`] gives it: id, capacity, entries
/// `(hash, depth, last_used)`.
pub type ExportedServer = (ServerId, u64, Vec<(u64, u32, Tick)>);

/// The in-memory prefix store.
pub struct MemoryStore {
    config: StoreConfig,
    shards: Box<[PaddedShard]>,
    registry: ArcSwap<Registry>,
    registry_writer: Mutex<SlotAllocator>,
}

impl MemoryStore {
    pub fn new(config: StoreConfig) -> Result<Self, StoreError> {
        config.validate()?;
        Ok(Self {
            config,
            shards: (0..SHARDS).map(|_| PaddedShard::default()).collect(),
            registry: ArcSwap::default(),
            registry_writer: Mutex::default(),
        })
    }

    /// Total entries over all servers.
    pub fn entries(&self) -> u64 {
        let registry = self.registry.load();
        registry
            .servers
            .values()
            .map(|s| s.state.lock().lru.len())
            .sum()
    }

    /// Holder stamps in the index (equals [`Self::entries`] when the store is consistent).
    #[doc(hidden)]
    pub fn index_stamps(&self) -> u64 {
        self.shards
            .iter()
            .map(|shard| shard.0.read().stamps())
            .sum()
    }

    fn server(&self, id: ServerId) -> Option<Arc<ServerNode>> {
        self.registry.load().servers.get(&id).cloned()
    }

    fn server_or_register(&self, id: ServerId) -> Result<Arc<ServerNode>, StoreError> {
        if let Some(node) = self.server(id) {
            return Ok(node);
        }
        let mut slots = self.registry_writer.lock();
        let current = self.registry.load_full();
        if let Some(node) = current.servers.get(&id) {
            return Ok(node.clone());
        }
        let slot = match slots.free.pop() {
            Some(slot) => slot,
            None if slots.next < MAX_SERVERS => {
                slots.next += 1;
                slots.next - 1
            }
            None => {
                return Err(StoreError::InvalidArgument(format!(
                    "the memory store holds at most {MAX_SERVERS} servers"
                )))
            }
        };
        let node = Arc::new(ServerNode {
            slot,
            state: Mutex::new(ServerState {
                lru: Lru::new(self.config.default_capacity),
                dropped: false,
            }),
        });
        let mut next = Registry::clone(&current);
        next.servers.insert(id, node.clone());
        if next.ids.len() <= slot as usize {
            next.ids.resize(slot as usize + 1, None);
        }
        next.ids[slot as usize] = Some(id);
        self.registry.store(Arc::new(next));
        Ok(node)
    }

    /// Removes the index stamps of the server in `slot` on `hashes`, one shard lock at a time.
    /// Sorts `hashes`.
    fn unindex(&self, slot: u32, hashes: &mut [u64]) {
        hashes.sort_unstable_by_key(|&h| shard_of(h));
        for group in hashes.chunk_by(|a, b| shard_of(*a) == shard_of(*b)) {
            let mut shard = self.shards[shard_of(group[0])].0.write();
            shard.warm(group);
            for &hash in group {
                shard.remove(hash, slot);
            }
        }
    }

    /// Evicts until the server is within capacity; returns how many.
    fn evict_to_capacity(&self, slot: u32, lru: &mut Lru, victims: &mut Vec<u64>) -> u64 {
        victims.clear();
        let evicted = lru.evict_to_capacity(victims);
        self.unindex(slot, victims);
        evicted
    }

    /// Every server with its capacity and entries `(hash, depth, last_used)`: the whole state,
    /// for a durable store's snapshot.
    pub fn export(&self) -> Vec<ExportedServer> {
        let registry = self.registry.load();
        let mut out: Vec<_> = registry
            .servers
            .iter()
            .map(|(&id, node)| {
                let state = node.state.lock();
                let entries = state
                    .lru
                    .iter()
                    .map(|(t, e)| (e.hash(), e.depth(), Tick::from_millis(t)))
                    .collect();
                (id, state.lru.capacity, entries)
            })
            .collect();
        out.sort_unstable_by_key(|(id, _, _)| *id);
        out
    }

    /// Puts back a server exported by [`Self::export`] (into a store that does not hold it):
    /// entries as they were, no eviction.
    pub fn restore(
        &self,
        server: ServerId,
        capacity: u64,
        entries: &mut [(u64, u32, Tick)],
    ) -> Result<(), StoreError> {
        check_capacity(capacity)?;
        let node = self.server_or_register(server)?;
        let mut state = node.state.lock();
        state.lru.capacity = capacity;
        // Groups of one `last_used`, each in keep order (depth ascending, hash descending).
        entries.sort_unstable_by_key(|&(h, d, t)| (t, d, std::cmp::Reverse(h)));
        for group in entries.chunk_by(|a, b| a.2 == b.2) {
            let tick = group[0].2;
            let touched: Vec<LruEntry> =
                group.iter().map(|&(h, d, _)| LruEntry::new(d, h)).collect();
            for &(h, _, _) in group {
                self.shards[shard_of(h)]
                    .0
                    .write()
                    .upsert(h, node.slot, tick);
            }
            state.lru.touch(tick, &mut [], &touched);
        }
        Ok(())
    }

    /// Merges entries `(hash, depth, last_used)` exported by another store (a peer replica's
    /// snapshot) into a server that may already hold some: each entry is inserted or refreshed
    /// to the later of the two `last_used`, as a notify would, then the server is evicted to
    /// its capacity. Returns the entries evicted. A prefix-closed export stays prefix-closed.
    pub fn merge(
        &self,
        server: ServerId,
        entries: &mut [(u64, u32, Tick)],
    ) -> Result<u64, StoreError> {
        loop {
            let node = self.server_or_register(server)?;
            let mut state = node.state.lock();
            if state.dropped {
                continue;
            }
            let lru = &mut state.lru;
            entries.sort_unstable_by_key(|&(h, d, t)| (t, d, std::cmp::Reverse(h)));
            let mut victims = Vec::new();
            for group in entries.chunk_by(|a, b| a.2 == b.2) {
                let tick = group[0].2;
                let mut moved = Vec::new();
                let mut touched = Vec::with_capacity(group.len());
                for &(h, d, _) in group {
                    let depth = d.clamp(1, crate::store::MAX_CAPACITY as u32);
                    let entry = LruEntry::new(depth, h);
                    let old = self.shards[shard_of(h)]
                        .0
                        .write()
                        .upsert(h, node.slot, tick);
                    restamp(old, tick, entry, &mut moved, &mut touched);
                }
                lru.touch(tick, &mut moved, &touched);
            }
            return Ok(self.evict_to_capacity(node.slot, lru, &mut victims));
        }
    }

    /// [`PrefixStore::notify`] without the future.
    pub fn notify_now(
        &self,
        hashes: &PrefixHashes,
        server: ServerId,
        t: Tick,
    ) -> Result<NotifyOutcome, StoreError> {
        let chunks = hashes.len() as u64;
        loop {
            let node = self.server_or_register(server)?;
            let mut state = node.state.lock();
            if state.dropped {
                continue;
            }
            let lru = &mut state.lru;
            // Entries deeper than the capacity would be evicted at once (a prefix-closed set of
            // at most `capacity` entries cannot reach them): count them without storing them.
            let kept = chunks.min(lru.capacity) as usize;
            let beyond = chunks - kept as u64;
            return SCRATCH.with(|scratch| {
                let Scratch {
                    old_ticks,
                    moved,
                    touched,
                    victims,
                    ..
                } = &mut *scratch.borrow_mut();
                let hashes = &hashes.as_slice()[..kept];
                old_ticks.clear();
                if let Some(&first) = hashes.first() {
                    let mut shard = self.shards[shard_of(first)].0.write();
                    shard.warm(hashes);
                    old_ticks.extend(hashes.iter().map(|&h| shard.upsert(h, node.slot, t)));
                }
                moved.clear();
                touched.clear();
                let mut inserted = beyond;
                for (i, (&h, &old)) in hashes.iter().zip(old_ticks.iter()).enumerate() {
                    // kept <= capacity <= MAX_CAPACITY < 2^22: the depth fits.
                    let entry = LruEntry::new(i as u32 + 1, h);
                    inserted += u64::from(restamp(old, t, entry, moved, touched));
                }
                lru.touch(t, moved, touched);
                let evicted = beyond + self.evict_to_capacity(node.slot, lru, victims);
                Ok(NotifyOutcome {
                    chunks,
                    inserted,
                    evicted,
                })
            });
        }
    }

    /// [`PrefixStore::query`] without the future.
    pub fn query_now(
        &self,
        hashes: &PrefixHashes,
        candidates: &[ServerId],
        t: Tick,
    ) -> Result<QueryOutcome, StoreError> {
        check_candidates(candidates)?;
        let registry = self.registry.load();
        let cutoff = self
            .config
            .ttl_ms
            .map_or(Tick::default(), |ttl| t.ttl_cutoff(ttl));
        SCRATCH.with(|scratch| {
            let Scratch {
                progress,
                marks,
                holders,
                matched,
                ..
            } = &mut *scratch.borrow_mut();
            holders.clear();
            let n = registry.ids.len();
            if progress.len() < n {
                progress.resize(n, 0);
                marks.resize(n, false);
            }
            if let Some(&first) = hashes.as_slice().first() {
                let shard = self.shards[shard_of(first)].0.read();
                holders.extend(
                    shard
                        .holders(first)
                        .iter()
                        .filter(|s| s.tick() >= cutoff && (s.slot() as usize) < n)
                        .map(|s| s.slot()),
                );
                let search = Bisection {
                    shard: &shard,
                    hashes: hashes.as_slice(),
                    cutoff,
                };
                search.run(1, hashes.len(), holders, marks, progress);
            }
            matched.clear();
            for &slot in holders.iter() {
                let p = progress[slot as usize];
                if let Some(&Some(id)) = registry.ids.get(slot as usize) {
                    matched.push((id, p));
                }
            }
            let matches = if matched.len() <= 8 {
                candidates
                    .iter()
                    .map(|id| {
                        matched
                            .iter()
                            .find(|(held, _)| held == id)
                            .map_or(0, |&(_, m)| u64::from(m))
                    })
                    .collect()
            } else {
                matched.sort_unstable();
                candidates
                    .iter()
                    .map(|id| {
                        matched
                            .binary_search_by_key(id, |&(id, _)| id)
                            .map_or(0, |i| u64::from(matched[i].1))
                    })
                    .collect()
            };
            Ok(QueryOutcome::from_matches(
                candidates,
                matches,
                hashes.len() as u64,
            ))
        })
    }

    /// [`PrefixStore::drop_server`] without the future.
    pub fn drop_server_now(&self, server: ServerId) -> u64 {
        let mut slots = self.registry_writer.lock();
        let current = self.registry.load_full();
        let Some(node) = current.servers.get(&server).cloned() else {
            return 0;
        };
        let mut next = Registry::clone(&current);
        next.servers.remove(&server);
        next.ids[node.slot as usize] = None;
        self.registry.store(Arc::new(next));
        let mut state = node.state.lock();
        state.dropped = true;
        let mut hashes = Vec::new();
        state.lru.clear(&mut hashes);
        self.unindex(node.slot, &mut hashes);
        slots.free.push(node.slot);
        hashes.len() as u64
    }

    /// [`PrefixStore::set_capacity`] without the future.
    pub fn set_capacity_now(&self, server: ServerId, capacity: u64) -> Result<u64, StoreError> {
        check_capacity(capacity)?;
        loop {
            let node = self.server_or_register(server)?;
            let mut state = node.state.lock();
            if state.dropped {
                continue;
            }
            state.lru.capacity = capacity;
            let mut victims = Vec::new();
            return Ok(self.evict_to_capacity(node.slot, &mut state.lru, &mut victims));
        }
    }

    /// [`PrefixStore::servers`] without the future.
    pub fn servers_now(&self) -> Vec<ServerInfo> {
        let registry = self.registry.load();
        let mut servers: Vec<ServerInfo> = registry
            .servers
            .iter()
            .map(|(&server_id, node)| {
                let state = node.state.lock();
                ServerInfo {
                    server_id,
                    entries: state.lru.len(),
                    capacity: state.lru.capacity,
                }
            })
            .collect();
        servers.sort_unstable_by_key(|s| s.server_id);
        servers
    }

    /// [`PrefixStore::purge_expired`] without the future.
    pub fn purge_expired_now(&self, now: Tick) -> u64 {
        let Some(ttl) = self.config.ttl_ms else {
            return 0;
        };
        let cutoff = now.ttl_cutoff(ttl);
        let registry = self.registry.load_full();
        let mut purged = 0;
        let mut victims = Vec::new();
        for node in registry.servers.values() {
            victims.clear();
            purged += node.state.lock().lru.purge_before(cutoff, &mut victims);
            self.unindex(node.slot, &mut victims);
        }
        purged
    }
}

#[async_trait]
impl PrefixStore for MemoryStore {
    async fn notify(
        &self,
        hashes: &PrefixHashes,
        server: ServerId,
        t: Tick,
    ) -> Result<NotifyOutcome, StoreError> {
        self.notify_now(hashes, server, t)
    }

    async fn query(
        &self,
        hashes: &PrefixHashes,
        candidates: &[ServerId],
        t: Tick,
    ) -> Result<QueryOutcome, StoreError> {
        self.query_now(hashes, candidates, t)
    }

    async fn drop_server(&self, server: ServerId) -> Result<u64, StoreError> {
        Ok(self.drop_server_now(server))
    }

    async fn set_capacity(&self, server: ServerId, capacity: u64) -> Result<u64, StoreError> {
        self.set_capacity_now(server, capacity)
    }

    async fn servers(&self) -> Result<Vec<ServerInfo>, StoreError> {
        Ok(self.servers_now())
    }

    async fn purge_expired(&self, now: Tick) -> Result<u64, StoreError> {
        Ok(self.purge_expired_now(now))
    }

    fn as_memory(&self) -> Option<&MemoryStore> {
        Some(self)
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}
