//! The token-block index: which backend holds which KV-cache blocks, as the backends report
//! them (vLLM's KV-cache events), so that routing can match a request's token blocks against
//! what each backend really holds instead of estimating it.
//!
//! Blocks are named by our own chained hash over their token ids ([`BlockHasher`]): block `i`
//! of a sequence is `H(name of block i-1, tokens of block i)`, so one name stands for the whole
//! prefix up to it, like vLLM's own block hashes (which are not reproduced: a backend's
//! `stored` report carries its hashes and the tokens, and the index maps its hash to ours so a
//! later `removed` finds the block).
//!
//! Like the memory store, every name of one sequence carries the top bits of its first block's
//! name, so a whole request (and a whole report) lives in one shard: one lock per query.
//! Entries come and go only with reports (there is no capacity to guess); a per-backend bound
//! keeps a publisher that never reports removals from growing the index without limit.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::hashing::{shard_of, SHARD_BITS};
use crate::ServerId;

const SHARD_MASK: u64 = !(u64::MAX >> SHARD_BITS);
const SHARDS: usize = 1 << SHARD_BITS;

/// Names full blocks of token ids by a chained hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
}

impl BlockHasher {
    /// `block_size` tokens per block (at least 1); `seed` separates namespaces (a secret one
    /// keeps crafted prompts from colliding with other tenants' blocks).
    pub fn new(block_size: usize, seed: u64) -> Self {
        Self {
            block_size: block_size.max(1),
            seed,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The name of the block after `parent` (None: the first block of a sequence).
    pub fn next(&self, parent: Option<u64>, block: &[u32]) -> u64 {
        let mut bytes = [0u8; 4 * 64];
        let seed = parent.map_or(self.seed, |p| p ^ 0x9E37_79B9_7F4A_7C15);
        let h = if block.len() <= 64 {
            for (i, t) in block.iter().enumerate() {
                bytes[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
            }
            xxh3_64_with_seed(&bytes[..4 * block.len()], seed)
        } else {
            let owned: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxh3_64_with_seed(&owned, seed)
        };
        match parent {
            // The first block's top bits name the shard of the whole sequence.
            None => h,
            Some(p) => (h & !SHARD_MASK) | (p & SHARD_MASK),
        }
    }

    /// The names of every full block of `tokens` (a trailing partial block is not cached by
    /// vLLM, so it is not named).
    pub fn hash(&self, tokens: &[u32]) -> Vec<u64> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut parent = None;
        for block in tokens.chunks_exact(self.block_size) {
            let h = self.next(parent, block);
            out.push(h);
            parent = Some(h);
        }
        out
    }
}

/// The backends holding one block: one inline, more in a list.
#[derive(Clone, Debug)]
enum Holders {
    One(u32),
    Many(Vec<u32>),
}

impl Holders {
    fn contains(&self, slot: u32) -> bool {
        match self {
            Holders::One(s) => *s == slot,
            Holders::Many(v) => v.contains(&slot),
        }
    }

    /// Adds `slot`; false if it was there.
    fn add(&mut self, slot: u32) -> bool {
        if self.contains(slot) {
            return false;
        }
        match self {
            Holders::One(s) => {
                let first = *s;
                *self = Holders::Many(vec![first, slot]);
            }
            Holders::Many(v) => v.push(slot),
        }
        true
    }

    /// Removes `slot`; returns whether the block is now held by nobody.
    fn remove(&mut self, slot: u32) -> bool {
        match self {
            Holders::One(s) => *s == slot,
            Holders::Many(v) => {
                v.retain(|s| *s != slot);
                match v.as_slice() {
                    [] => true,
                    [only] => {
                        let only = *only;
                        *self = Holders::One(only);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}

/// What one backend holds: its hashes mapped to our names.
struct Backend {
    slot: u32,
    blocks: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    names: HashMap<u64, u64, foldhash::fast::RandomState>,
    /// Set by [`BlockIndex::clear`] under this lock: a report that took the backend before
    /// it was cleared adds nothing (its slot may already name another backend).
    gone: bool,
}

/// Why a report was not (fully) applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("the report's parent block was never reported")]
    UnknownParent,
    #[error("the report's token count is not its block count times its block size")]
    WrongLength,
    #[error("the report's block size differs from the index's")]
    WrongBlockSize,
    #[error("the backend holds the most blocks the index keeps for one backend")]
    Full,
}

/// The token-block index of every backend.
pub struct BlockIndex {
    hasher: BlockHasher,
    shards: Box<[RwLock<HashMap<u64, Holders, foldhash::fast::RandomState>>]>,
    backends: RwLock<HashMap<ServerId, Arc<Backend>>>,
    free_slots: Mutex<(u32, Vec<u32>)>,
    max_blocks_per_backend: usize,
}

impl BlockIndex {
    /// An empty index naming blocks with `hasher`, keeping at most `max_blocks_per_backend`
    /// blocks of any one backend.
    pub fn new(hasher: BlockHasher, max_blocks_per_backend: usize) -> Self {
        Self {
            hasher,
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            backends: RwLock::default(),
            free_slots: Mutex::new((0, Vec::new())),
            max_blocks_per_backend,
        }
    }

    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    fn backend(&self, id: ServerId) -> Arc<Backend> {
        if let Some(b) = self.backends.read().get(&id) {
            return b.clone();
        }
        let mut backends = self.backends.write();
        backends
            .entry(id)
            .or_insert_with(|| {
                let mut free = self.free_slots.lock();
                let slot = free.1.pop().unwrap_or_else(|| {
                    free.0 += 1;
                    free.0 - 1
                });
                Arc::new(Backend {
                    slot,
                    blocks: Mutex::default(),
                })
            })
            .clone()
    }

    /// `backend` reports it cached `external.len()` blocks after `parent`, holding `tokens`
    /// (`block_size` per block). Returns the blocks newly held.
    pub fn stored(
        &self,
        backend: ServerId,
        parent: Option<u64>,
        external: &[u64],
        tokens: &[u32],
        block_size: usize,
    ) -> Result<usize, BlockError> {
        if block_size != self.hasher.block_size {
            return Err(BlockError::WrongBlockSize);
        }
        if tokens.len() != external.len() * block_size {
            return Err(BlockError::WrongLength);
        }
        let b = self.backend(backend);
        let mut held = b.blocks.lock();
        if held.gone {
            return Ok(0);
        }
        let blocks = &mut held.names;
        let mut ours = match parent {
            None => None,
            Some(p) => Some(*blocks.get(&p).ok_or(BlockError::UnknownParent)?),
        };
        let mut names = Vec::with_capacity(external.len());
        for (ext, block) in external.iter().zip(tokens.chunks_exact(block_size)) {
            let name = self.hasher.next(ours, block);
            names.push((*ext, name));
            ours = Some(name);
        }
        let Some(&(_, first)) = names.first() else {
            return Ok(0);
        };
        let here = shard_of(first);
        // Names a reused hash stood for before, living in another sequence's shard.
        let mut elsewhere = Vec::new();
        let mut shard = self.shards[here].write();
        let mut added = 0;
        let mut outcome = Ok(());
        for (ext, name) in names {
            if blocks.len() >= self.max_blocks_per_backend && !blocks.contains_key(&ext) {
                outcome = Err(BlockError::Full);
                break;
            }
            if let Some(old) = blocks.insert(ext, name) {
                if old == name {
                    continue;
                }
                // The same hash named other tokens (a reused id): the old block goes, from
                // the shard of its own sequence.
                if shard_of(old) == here {
                    drop_holder(&mut shard, old, b.slot);
                } else {
                    elsewhere.push(old);
                }
            }
            match shard.entry(name) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Holders::One(b.slot));
                    added += 1;
                }
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    if o.get_mut().add(b.slot) {
                        added += 1;
                    }
                }
            }
        }
        drop(shard);
        self.drop_names(&mut elsewhere, b.slot);
        outcome.map(|()| added)
    }

    /// Drops `slot` from the holders of `names` (sorted here), one shard lock at a time.
    fn drop_names(&self, names: &mut [u64], slot: u32) {
        names.sort_unstable_by_key(|&n| shard_of(n));
        for group in names.chunk_by(|a, c| shard_of(*a) == shard_of(*c)) {
            let mut shard = self.shards[shard_of(group[0])].write();
            for &name in group {
                drop_holder(&mut shard, name, slot);
            }
        }
    }

    /// `backend` reports it evicted these blocks. Returns how many it held; the rest were
    /// unknown (never reported, or reported before this index listened).
    pub fn removed(&self, backend: ServerId, external: &[u64]) -> usize {
        let Some(b) = self.backends.read().get(&backend).cloned() else {
            return 0;
        };
        let mut held = b.blocks.lock();
        let mut names: Vec<u64> = external
            .iter()
            .filter_map(|e| held.names.remove(e))
            .collect();
        self.drop_names(&mut names, b.slot);
        names.len()
    }

    /// `backend` emptied its cache, or left: every block it held goes. Returns how many.
    pub fn clear(&self, backend: ServerId) -> usize {
        let Some(b) = self.backends.write().remove(&backend) else {
            return 0;
        };
        let mut held = b.blocks.lock();
        held.gone = true;
        let mut names: Vec<u64> = std::mem::take(&mut held.names).into_values().collect();
        self.drop_names(&mut names, b.slot);
        drop(held);
        // Only now may another backend take the slot: no holder of it is left.
        self.free_slots.lock().1.push(b.slot);
        names.len()
    }

    /// Blocks held, all backends together.
    pub fn total_blocks(&self) -> usize {
        self.backends
            .read()
            .values()
            .map(|b| b.blocks.lock().names.len())
            .sum()
    }

    /// The memory the index's tables take (their allocated capacity, not only their entries):
    /// what bounds it is the blocks the backends hold now, not how many came and went.
    pub fn approx_bytes(&self) -> usize {
        let name_entry = std::mem::size_of::<(u64, Holders)>() + 1;
        let names: usize = self
            .shards
            .iter()
            .map(|s| {
                let shard = s.read();
                let lists: usize = shard
                    .values()
                    .map(|h| match h {
                        Holders::One(_) => 0,
                        Holders::Many(v) => v.capacity() * 4,
                    })
                    .sum();
                shard.capacity() * name_entry + lists
            })
            .sum();
        let hash_entry = std::mem::size_of::<(u64, u64)>() + 1;
        let hashes: usize = self
            .backends
            .read()
            .values()
            .map(|b| b.blocks.lock().names.capacity() * hash_entry)
            .sum();
        names + hashes
    }

    /// Blocks `backend` holds.
    pub fn blocks(&self, backend: ServerId) -> usize {
        self.backends
            .read()
            .get(&backend)
            .map_or(0, |b| b.blocks.lock().names.len())
    }

    /// For each candidate, in order, the number of leading blocks of `request` (names from
    /// [`BlockHasher::hash`]) it holds.
    pub fn matches(&self, request: &[u64], candidates: &[ServerId]) -> Vec<u64> {
        let mut matched = vec![0u64; candidates.len()];
        let Some(&first) = request.first() else {
            return matched;
        };
        let slots: Vec<Option<u32>> = {
            let backends = self.backends.read();
            candidates
                .iter()
                .map(|id| backends.get(id).map(|b| b.slot))
                .collect()
        };
        let mut alive: Vec<usize> = (0..candidates.len())
            .filter(|&i| slots[i].is_some())
            .collect();
        let shard = self.shards[shard_of(first)].read();
        for (depth, name) in request.iter().enumerate() {
            if alive.is_empty() {
                break;
            }
            let Some(holders) = shard.get(name) else {
                break;
            };
            alive.retain(|&i| {
                let held = slots[i].is_some_and(|s| holders.contains(s));
                if held {
                    matched[i] = depth as u64 + 1;
                }
                held
            });
        }
        matched
    }
}

fn drop_holder(
    shard: &mut HashMap<u64, Holders, foldhash::fast::RandomState>,
    name: u64,
    slot: u32,
) {
    if let Some(held) = shard.get_mut(&name) {
        if held.remove(slot) {
            shard.remove(&name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> BlockIndex {
        BlockIndex::new(BlockHasher::new(2, 7), 1000)
    }

    #[test]
    fn sequences_share_their_shard_and_prefixes_their_names() {
        let h = BlockHasher::new(2, 0);
        let a = h.hash(&[1, 2, 3, 4, 5, 6, 7]);
        let b = h.hash(&[1, 2, 3, 4, 9, 9]);
        assert_eq!(a.len(), 3, "the partial block is not named");
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert!(a.iter().all(|&n| shard_of(n) == shard_of(a[0])));
        assert_ne!(
            h.hash(&[3, 4]),
            h.hash(&[1, 2, 3, 4])[1..],
            "position matters"
        );
    }

    #[test]
    fn reports_make_matches() {
        let idx = index();
        let h = *idx.hasher();
        let tokens = [1, 2, 3, 4, 5, 6];
        // Backend 10 caches the first two blocks, then the third after them.
        assert_eq!(idx.stored(10, None, &[100, 101], &tokens[..4], 2), Ok(2));
        assert_eq!(idx.stored(10, Some(101), &[102], &tokens[4..], 2), Ok(1));
        // Backend 20 caches only the first block.
        assert_eq!(idx.stored(20, None, &[900], &tokens[..2], 2), Ok(1));
        let request = h.hash(&[1, 2, 3, 4, 5, 6, 8, 8]);
        assert_eq!(idx.matches(&request, &[20, 10, 30]), vec![1, 3, 0]);
        // Eviction of the middle block cuts the match there (not prefix-closed: still exact).
        assert_eq!(idx.removed(10, &[101, 555]), 1);
        assert_eq!(idx.matches(&request, &[10, 20]), vec![1, 1]);
        assert_eq!(idx.clear(20), 1);
        assert_eq!(idx.matches(&request, &[10, 20]), vec![1, 0]);
        assert_eq!(idx.blocks(10), 2);
    }

    #[test]
    fn bad_reports_change_nothing() {
        let idx = index();
        assert_eq!(
            idx.stored(1, Some(5), &[6], &[1, 2], 2),
            Err(BlockError::UnknownParent)
        );
        assert_eq!(
            idx.stored(1, None, &[6], &[1, 2, 3], 2),
            Err(BlockError::WrongLength)
        );
        assert_eq!(
            idx.stored(1, None, &[6], &[1, 2, 3], 3),
            Err(BlockError::WrongBlockSize)
        );
        assert_eq!(idx.blocks(1), 0);
        let small = BlockIndex::new(BlockHasher::new(1, 0), 2);
        assert_eq!(small.stored(1, None, &[1, 2], &[5, 6], 1), Ok(2));
        assert_eq!(
            small.stored(1, Some(2), &[3], &[7], 1),
            Err(BlockError::Full)
        );
        assert_eq!(small.blocks(1), 2);
    }

    fn names_in_shards(idx: &BlockIndex) -> usize {
        idx.shards.iter().map(|s| s.read().len()).sum()
    }

    /// A backend that reuses one hash for other tokens (vLLM recycles block ids): the old
    /// name leaves its own shard, so nothing is left behind for the cap to miss, for `clear`
    /// to keep, or for the slot's next backend to inherit.
    #[test]
    fn a_reused_hash_leaves_no_ghost_in_another_shard() {
        let idx = BlockIndex::new(BlockHasher::new(2, 0), 1000);
        let mut shards_seen = std::collections::HashSet::new();
        for round in 0..200u32 {
            let tokens = [round, round.wrapping_mul(7919)];
            idx.stored(1, None, &[1], &tokens, 2).unwrap();
            shards_seen.insert(shard_of(idx.hasher.hash(&tokens)[0]));
            assert_eq!(names_in_shards(&idx), 1, "round {round}");
        }
        assert!(shards_seen.len() > 1, "the rounds crossed shards");
        assert_eq!(idx.total_blocks(), 1);
        assert_eq!(idx.clear(1), 1);
        assert_eq!(names_in_shards(&idx), 0);
        // The freed slot's next backend holds nothing it did not report.
        let request = idx.hasher.hash(&[5, 5 * 7919]);
        assert_eq!(idx.matches(&request, &[2]), vec![0]);
    }

    /// Reports racing a clear never leave holders on the freed slot.
    #[test]
    fn reports_racing_a_clear_leave_nothing_behind() {
        let idx = std::sync::Arc::new(BlockIndex::new(BlockHasher::new(2, 0), 1 << 20));
        let writers: Vec<_> = (0..2u64)
            .map(|w| {
                let idx = idx.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let tokens = [(w * 1_000_000 + i) as u32, 3];
                        let _ = idx.stored(1, None, &[i], &tokens, 2);
                    }
                })
            })
            .collect();
        let clearer = {
            let idx = idx.clone();
            std::thread::spawn(move || {
                for _ in 0..2_000 {
                    idx.clear(1);
                }
            })
        };
        for t in writers {
            t.join().unwrap();
        }
        clearer.join().unwrap();
        idx.clear(1);
        assert_eq!(names_in_shards(&idx), 0);
        assert_eq!(idx.total_blocks(), 0);
    }

    #[test]
    fn memory_follows_the_reports_under_churn() {
        let idx = BlockIndex::new(BlockHasher::new(4, 0), 1 << 20);
        let mut live = std::collections::VecDeque::new();
        for round in 0..20_000u64 {
            let tokens: Vec<u32> = (0..16).map(|i| (round * 16 + i) as u32).collect();
            let ext: Vec<u64> = (0..4).map(|i| round * 4 + i).collect();
            idx.stored(1, None, &ext, &tokens, 4).unwrap();
            live.extend(ext);
            while live.len() > 1000 {
                let gone: Vec<u64> = live.drain(..4).collect();
                assert_eq!(idx.removed(1, &gone), 4);
            }
        }
        assert_eq!(idx.blocks(1), 1000);
        let entries: usize = idx.shards.iter().map(|s| s.read().len()).sum();
        assert_eq!(entries, 1000);
        assert_eq!(idx.clear(1), 1000);
        let entries: usize = idx.shards.iter().map(|s| s.read().len()).sum();
        assert_eq!(entries, 0);
    }

    /// Three backends holding 100k blocks each, with prefixes in common, storing four times as
    /// many blocks as they hold (evicting the oldest): the index holds exactly what the reports say, and its memory
    /// stays at what 100k blocks a backend take.
    #[test]
    fn memory_stays_bounded_under_churn_with_100k_blocks_per_backend() {
        const HELD: usize = 100_000;
        const BLOCKS_PER_PROMPT: u64 = 8;
        let idx = BlockIndex::new(BlockHasher::new(4, 0), 1 << 20);
        // Prompt p's tokens: a prefix shared by the prompts of one conversation (p / 4),
        // then its own blocks. Every backend caches every third prompt of the others' too.
        let report = |backend: u64, p: u64| {
            let tokens: Vec<u32> = (0..BLOCKS_PER_PROMPT * 4)
                .map(|i| {
                    if i < 8 {
                        (p / 4 * 8 + i) as u32
                    } else {
                        (p * 64 + i) as u32 | 1 << 31
                    }
                })
                .collect();
            // The backend's own hashes: any ids, distinct per (backend, prompt, block).
            let ext: Vec<u64> = (0..BLOCKS_PER_PROMPT)
                .map(|i| (backend << 48) | (p * BLOCKS_PER_PROMPT + i))
                .collect();
            idx.stored(backend, None, &ext, &tokens, 4).unwrap();
            ext
        };
        let mut live: Vec<std::collections::VecDeque<u64>> = vec![Default::default(); 3];
        let mut bytes_at_fill = 0;
        // Each backend gets two prompts of three: 400k blocks stored per backend in all.
        let total_prompts = 6 * HELD as u64 / BLOCKS_PER_PROMPT;
        for p in 0..total_prompts {
            for backend in 0..3u64 {
                if p % 3 != backend && p % 2 == 0 {
                    continue;
                }
                let held = &mut live[backend as usize];
                held.extend(report(backend, p));
                while held.len() > HELD {
                    let gone: Vec<u64> = held.drain(..BLOCKS_PER_PROMPT as usize).collect();
                    assert_eq!(idx.removed(backend, &gone), gone.len());
                }
            }
            if bytes_at_fill == 0 && live.iter().all(|l| l.len() >= HELD) {
                bytes_at_fill = idx.approx_bytes();
            }
        }
        assert!(bytes_at_fill > 0, "every backend reached 100k blocks");
        for backend in 0..3 {
            assert_eq!(idx.blocks(backend), HELD);
        }
        assert_eq!(idx.total_blocks(), 3 * HELD);
        let bytes = idx.approx_bytes();
        assert!(
            bytes <= bytes_at_fill * 3 / 2,
            "{bytes} bytes after the churn, {bytes_at_fill} when first full"
        );
        // Shared prefixes are one entry each: fewer names than blocks held.
        let names: usize = idx.shards.iter().map(|s| s.read().len()).sum();
        assert!(names < 3 * HELD, "{names}");
        for backend in 0..3 {
            assert_eq!(idx.clear(backend), HELD);
        }
        let names: usize = idx.shards.iter().map(|s| s.read().len()).sum();
        assert_eq!(names, 0);
    }
}
