//! The in-memory store: the default, and the fastest.
//!
//! Layout (why it is fast and small):
//! - The index is `prefix hash -> holders`, split into shards by the top bits that every prefix
//!   of a request shares (see [`crate::hashing::SHARD_BITS`]). A query takes one shard's read
//!   lock and walks the request's chain: O(chunks), whatever the number of servers or entries.
//! - A holder is a [`Stamp`]: the server's slot and the entry's `last_used`, packed in 63 bits, so
//!   a prefix held by one server costs one `u64` beside its key. Prefixes held by several servers
//!   point into a per-shard list of stamps.
//! - Each server keeps its eviction order in a `BTreeSet<u128>` of packed
//!   `(last_used, depth descending, hash)` keys under its own mutex: eviction is O(log n), and the
//!   hash in the key finds the entry's shard.
//!
//! Locks: a notify holds its server's mutex and takes one shard lock at a time; a query takes
//! one shard read lock. No operation holds two shard locks, and none takes the registry writer
//! lock while holding a server's mutex.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};

use crate::hashing::{shard_of, SHARD_BITS};
use crate::store::{check_candidates, check_capacity, MAX_CAPACITY};
use crate::{
    NotifyOutcome, PrefixHashes, PrefixStore, QueryOutcome, ServerId, ServerInfo, StoreConfig,
    StoreError, Tick,
};

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

const SHARDS: usize = 1 << SHARD_BITS;
const SLOT_BITS: u32 = 21;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
/// Servers that can be known at once (slots of dropped servers are reused).
pub const MAX_SERVERS: u32 = 1 << SLOT_BITS;
/// Marks an index value that points into the shard's holder lists instead of being a stamp.
const LIST_TAG: u64 = 1 << 63;
/// `progress` value of a slot that is not a candidate of the running query.
const NOT_CANDIDATE: u32 = u32::MAX;
const NO_SLOT: u32 = u32::MAX;

/// One server's hold on one prefix: `[0][last_used: 42 bits][slot: 21 bits]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
struct Stamp(u64);

impl Stamp {
    fn new(slot: u32, tick: Tick) -> Self {
        Stamp((tick.millis() << SLOT_BITS) | u64::from(slot))
    }
    fn slot(self) -> u32 {
        (self.0 & SLOT_MASK) as u32
    }
    fn tick(self) -> Tick {
        Tick::from_millis(self.0 >> SLOT_BITS)
    }
}

/// The packed eviction-order key: ascending order is eviction order.
fn lru_key(tick: Tick, depth: u64, hash: u64) -> u128 {
    debug_assert!((1..=MAX_CAPACITY).contains(&depth));
    (u128::from(tick.millis()) << 86) | (u128::from(MAX_CAPACITY - depth) << 64) | u128::from(hash)
}

fn lru_key_hash(key: u128) -> u64 {
    key as u64
}

fn lru_key_tick(key: u128) -> Tick {
    Tick::from_millis((key >> 86) as u64)
}

/// One shard of the index.
#[derive(Default)]
struct Shard {
    /// prefix hash -> a [`Stamp`], or `LIST_TAG | i` for `lists[i]` when 2+ servers hold it.
    index: FastMap<u64, u64>,
    lists: Vec<Vec<Stamp>>,
    free_lists: Vec<u32>,
}

impl Shard {
    fn holders<'a>(&'a self, value: &'a u64) -> &'a [Stamp] {
        if value & LIST_TAG == 0 {
            // SAFETY: Stamp is `repr(transparent)` over u64.
            std::slice::from_ref(unsafe { &*(value as *const u64 as *const Stamp) })
        } else {
            &self.lists[(value & !LIST_TAG) as usize]
        }
    }

    /// Adds or refreshes `slot`'s stamp on `hash`; returns the previous `last_used` if any.
    fn upsert(&mut self, hash: u64, slot: u32, tick: Tick) -> Option<Tick> {
        let Shard {
            index,
            lists,
            free_lists,
        } = self;
        let value = match index.entry(hash) {
            Entry::Vacant(vacant) => {
                vacant.insert(Stamp::new(slot, tick).0);
                return None;
            }
            Entry::Occupied(occupied) => occupied.into_mut(),
        };
        if *value & LIST_TAG == 0 {
            let stamp = Stamp(*value);
            if stamp.slot() == slot {
                *value = Stamp::new(slot, stamp.tick().max(tick)).0;
                return Some(stamp.tick());
            }
            let list = vec![stamp, Stamp::new(slot, tick)];
            let i = match free_lists.pop() {
                Some(i) => {
                    lists[i as usize] = list;
                    i
                }
                None => {
                    lists.push(list);
                    (lists.len() - 1) as u32
                }
            };
            *value = LIST_TAG | u64::from(i);
            return None;
        }
        let list = &mut lists[(*value & !LIST_TAG) as usize];
        match list.iter_mut().find(|s| s.slot() == slot) {
            Some(s) => {
                let old = s.tick();
                *s = Stamp::new(slot, old.max(tick));
                Some(old)
            }
            None => {
                list.push(Stamp::new(slot, tick));
                None
            }
        }
    }

    /// Removes `slot`'s stamp from `hash`; returns whether it was there.
    fn remove(&mut self, hash: u64, slot: u32) -> bool {
        let Some(value) = self.index.get_mut(&hash) else {
            return false;
        };
        if *value & LIST_TAG == 0 {
            if Stamp(*value).slot() != slot {
                return false;
            }
            self.index.remove(&hash);
            return true;
        }
        let i = (*value & !LIST_TAG) as usize;
        let list = &mut self.lists[i];
        let Some(pos) = list.iter().position(|s| s.slot() == slot) else {
            return false;
        };
        list.swap_remove(pos);
        if list.len() == 1 {
            *value = list[0].0;
            self.lists[i] = Vec::new();
            self.free_lists.push(i as u32);
        }
        true
    }
}

/// Aligned so that neighbouring shard locks do not share a cache line.
#[repr(align(128))]
#[derive(Default)]
struct PaddedShard(RwLock<Shard>);

/// A server's eviction state, under its own mutex.
struct Lru {
    capacity: u64,
    order: BTreeSet<u128>,
    /// Set when the server was dropped; a notify that raced with the drop starts over.
    dropped: bool,
}

struct ServerNode {
    slot: u32,
    lru: Mutex<Lru>,
}

/// id -> server, replaced whole on the rare registration or drop so readers never lock.
#[derive(Default, Clone)]
struct Registry {
    servers: FastMap<ServerId, Arc<ServerNode>>,
}

#[derive(Default)]
struct SlotAllocator {
    next: u32,
    free: Vec<u32>,
}

/// Per-thread buffers, so that a query or notify allocates nothing but its answer.
#[derive(Default)]
struct Scratch {
    /// Matched chunks so far, by slot; [`NOT_CANDIDATE`] for slots outside the query.
    progress: Vec<u32>,
    slots: Vec<u32>,
    old_ticks: Vec<Option<Tick>>,
    victims: Vec<u128>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

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
            .map(|s| s.lru.lock().order.len() as u64)
            .sum()
    }

    /// Holder stamps in the index (equals [`Self::entries`] when the store is consistent).
    #[doc(hidden)]
    pub fn index_stamps(&self) -> u64 {
        self.shards
            .iter()
            .map(|shard| {
                let shard = shard.0.read();
                shard
                    .index
                    .values()
                    .map(|v| shard.holders(v).len() as u64)
                    .sum::<u64>()
            })
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
            lru: Mutex::new(Lru {
                capacity: self.config.default_capacity,
                order: BTreeSet::new(),
                dropped: false,
            }),
        });
        let mut next = Registry::clone(&current);
        next.servers.insert(id, node.clone());
        self.registry.store(Arc::new(next));
        Ok(node)
    }

    /// Removes the index stamps of `keys` (entries of the server in `slot`), one shard lock at
    /// a time. Sorts `keys`.
    fn unindex(&self, slot: u32, keys: &mut [u128]) {
        keys.sort_unstable_by_key(|&k| shard_of(lru_key_hash(k)));
        for group in keys.chunk_by(|a, b| shard_of(lru_key_hash(*a)) == shard_of(lru_key_hash(*b)))
        {
            let mut shard = self.shards[shard_of(lru_key_hash(group[0]))].0.write();
            for &key in group {
                shard.remove(lru_key_hash(key), slot);
            }
        }
    }

    /// Evicts from the front of `lru.order` until it is within capacity; returns how many.
    fn evict_to_capacity(&self, slot: u32, lru: &mut Lru, victims: &mut Vec<u128>) -> u64 {
        victims.clear();
        while lru.order.len() as u64 > lru.capacity {
            victims.extend(lru.order.pop_first());
        }
        self.unindex(slot, victims);
        victims.len() as u64
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
            let mut lru = node.lru.lock();
            if lru.dropped {
                continue;
            }
            // Entries deeper than the capacity would be evicted at once (a prefix-closed set of
            // at most `capacity` entries cannot reach them): count them without storing them.
            let kept = chunks.min(lru.capacity) as usize;
            let beyond = chunks - kept as u64;
            return SCRATCH.with(|scratch| {
                let scratch = &mut *scratch.borrow_mut();
                let hashes = &hashes.as_slice()[..kept];
                scratch.old_ticks.clear();
                if let Some(&first) = hashes.first() {
                    let mut shard = self.shards[shard_of(first)].0.write();
                    scratch
                        .old_ticks
                        .extend(hashes.iter().map(|&h| shard.upsert(h, node.slot, t)));
                }
                let mut inserted = beyond;
                for (i, (&h, &old)) in hashes.iter().zip(&scratch.old_ticks).enumerate() {
                    let depth = i as u64 + 1;
                    match old {
                        None => {
                            inserted += 1;
                            lru.order.insert(lru_key(t, depth, h));
                        }
                        Some(old) if old < t => {
                            lru.order.remove(&lru_key(old, depth, h));
                            lru.order.insert(lru_key(t, depth, h));
                        }
                        Some(_) => {}
                    }
                }
                let evicted =
                    beyond + self.evict_to_capacity(node.slot, &mut lru, &mut scratch.victims);
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
            let scratch = &mut *scratch.borrow_mut();
            let (progress, slots) = (&mut scratch.progress, &mut scratch.slots);
            slots.clear();
            for id in candidates {
                let slot = registry.servers.get(id).map_or(NO_SLOT, |s| s.slot);
                slots.push(slot);
                if slot != NO_SLOT {
                    let slot = slot as usize;
                    if progress.len() <= slot {
                        progress.resize(slot + 1, NOT_CANDIDATE);
                    }
                    progress[slot] = 0;
                }
            }
            if let Some(&first) = hashes.as_slice().first() {
                let shard = self.shards[shard_of(first)].0.read();
                for (depth, hash) in hashes.as_slice().iter().enumerate() {
                    let Some(value) = shard.index.get(hash) else {
                        break;
                    };
                    let mut advanced = false;
                    for stamp in shard.holders(value) {
                        if let Some(p) = progress.get_mut(stamp.slot() as usize) {
                            if *p == depth as u32 && stamp.tick() >= cutoff {
                                *p += 1;
                                advanced = true;
                            }
                        }
                    }
                    if !advanced {
                        break;
                    }
                }
            }
            let matches = slots
                .iter()
                .map(|&slot| progress.get(slot as usize).map_or(0, |&p| u64::from(p)))
                .collect();
            for &slot in slots.iter() {
                if let Some(p) = progress.get_mut(slot as usize) {
                    *p = NOT_CANDIDATE;
                }
            }
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
        self.registry.store(Arc::new(next));
        let mut lru = node.lru.lock();
        lru.dropped = true;
        let mut keys: Vec<u128> = std::mem::take(&mut lru.order).into_iter().collect();
        self.unindex(node.slot, &mut keys);
        slots.free.push(node.slot);
        keys.len() as u64
    }

    /// [`PrefixStore::set_capacity`] without the future.
    pub fn set_capacity_now(&self, server: ServerId, capacity: u64) -> Result<u64, StoreError> {
        check_capacity(capacity)?;
        loop {
            let node = self.server_or_register(server)?;
            let mut lru = node.lru.lock();
            if lru.dropped {
                continue;
            }
            lru.capacity = capacity;
            let mut victims = Vec::new();
            return Ok(self.evict_to_capacity(node.slot, &mut lru, &mut victims));
        }
    }

    /// [`PrefixStore::servers`] without the future.
    pub fn servers_now(&self) -> Vec<ServerInfo> {
        let registry = self.registry.load();
        let mut servers: Vec<ServerInfo> = registry
            .servers
            .iter()
            .map(|(&server_id, node)| {
                let lru = node.lru.lock();
                ServerInfo {
                    server_id,
                    entries: lru.order.len() as u64,
                    capacity: lru.capacity,
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
            let mut lru = node.lru.lock();
            victims.clear();
            while let Some(&key) = lru.order.first() {
                if lru_key_tick(key) >= cutoff {
                    break;
                }
                victims.extend(lru.order.pop_first());
            }
            self.unindex(node.slot, &mut victims);
            purged += victims.len() as u64;
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

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_and_key_round_trip() {
        let t = Tick::from_millis(crate::time::MAX_TICK);
        let s = Stamp::new(MAX_SERVERS - 1, t);
        assert_eq!(s.slot(), MAX_SERVERS - 1);
        assert_eq!(s.tick(), t);
        assert_eq!(s.0 & LIST_TAG, 0);
        let k = lru_key(t, 1, u64::MAX);
        assert_eq!(lru_key_hash(k), u64::MAX);
        assert_eq!(lru_key_tick(k), t);
        // Older first; among equal times deeper first; then lower hash.
        assert!(lru_key(Tick::from_millis(1), 1, 0) < lru_key(Tick::from_millis(2), 9, 0));
        assert!(lru_key(Tick::from_millis(1), 9, 5) < lru_key(Tick::from_millis(1), 1, 0));
        assert!(lru_key(Tick::from_millis(1), 3, 4) < lru_key(Tick::from_millis(1), 3, 5));
    }

    #[test]
    fn shard_holder_lists_grow_and_shrink() {
        let mut shard = Shard::default();
        let t = Tick::from_millis(10);
        assert_eq!(shard.upsert(42, 1, t), None);
        assert_eq!(shard.upsert(42, 2, t), None);
        assert_eq!(shard.upsert(42, 3, t), None);
        assert_eq!(shard.upsert(42, 2, Tick::from_millis(20)), Some(t));
        assert_eq!(shard.holders(&shard.index[&42]).len(), 3);
        assert!(shard.remove(42, 1));
        assert!(shard.remove(42, 3));
        assert!(!shard.remove(42, 3));
        // Back to one inline stamp, the list slot freed for reuse.
        assert_eq!(shard.index[&42] & LIST_TAG, 0);
        assert_eq!(shard.free_lists.len(), 1);
        assert_eq!(Stamp(shard.index[&42]).tick(), Tick::from_millis(20));
        assert!(shard.remove(42, 2));
        assert!(shard.index.is_empty());
    }
}
