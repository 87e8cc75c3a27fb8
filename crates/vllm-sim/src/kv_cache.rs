//! A KV cache with automatic prefix caching, modelled on vLLM's block pool.
//!
//! - Memory is `num_blocks` blocks of `block_size` tokens. A full block is named by a chained
//!   hash of its tokens and everything before them; only full blocks are cached.
//! - A request's leading blocks found in the cache are reused (pinned, not recomputed). vLLM
//!   always computes at least the last prompt token, so a fully cached prompt gives back its last
//!   block.
//! - Running requests pin their blocks. A finished request's blocks go to the tail of an LRU
//!   free queue, its last block first, so that chains are evicted from the tail. A new block is
//!   taken from the head of the free queue, evicting whatever was cached in it.

use std::collections::HashMap;

use xxhash_rust::xxh3::Xxh3;

use crate::tokens::TokenId;

const NONE: u32 = u32::MAX;

/// The chained hash of every full block of `ids`.
pub fn block_hashes(ids: &[TokenId], block_size: usize) -> Vec<u64> {
    let mut prev = 0u64;
    ids.chunks_exact(block_size)
        .map(|block| {
            let mut h = Xxh3::new();
            h.update(&prev.to_le_bytes());
            for id in block {
                h.update(&id.to_le_bytes());
            }
            prev = h.digest();
            prev
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
struct Block {
    hash: Option<u64>,
    refs: u32,
    prev: u32,
    next: u32,
}

/// Blocks held by one request.
#[derive(Debug, Default)]
pub struct Allocation {
    blocks: Vec<u32>,
    /// Leading blocks that came from the cache.
    hit_blocks: usize,
    /// Leading blocks registered in the cache (hits included).
    committed: usize,
}

impl Allocation {
    /// Prompt tokens served from the cache.
    pub fn cached_blocks(&self) -> usize {
        self.hit_blocks
    }
}

/// Why an allocation could not be made now.
#[derive(Debug, PartialEq, Eq)]
pub enum Shortage {
    /// Not enough free blocks now; retry after a release.
    Wait,
    /// The request needs more blocks than the whole cache has.
    Never { needed: usize, total: usize },
}

/// A change of what the cache holds, as vLLM reports it in its KV-cache events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// Blocks `hashes` (after `parent`) were cached, holding `tokens`.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<TokenId>,
    },
    Removed(u64),
    Cleared,
}

pub struct KvCache {
    block_size: usize,
    blocks: Vec<Block>,
    cached: HashMap<u64, u32>,
    head: u32,
    tail: u32,
    free: usize,
    /// Changes since the last [`KvCache::take_events`], when events are published.
    events: Option<Vec<CacheEvent>>,
}

impl KvCache {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut cache = Self {
            block_size,
            blocks: vec![
                Block {
                    hash: None,
                    refs: 0,
                    prev: NONE,
                    next: NONE,
                };
                num_blocks
            ],
            cached: HashMap::new(),
            head: NONE,
            tail: NONE,
            free: 0,
            events: None,
        };
        for b in 0..num_blocks as u32 {
            cache.push_free(b);
        }
        cache
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Starts recording changes for [`KvCache::take_events`].
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The changes since the last call (empty unless recording).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Fraction of blocks pinned by running requests (vLLM's `kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free as f64 / self.blocks.len() as f64
    }

    /// Blocks of the prompt that a request arriving now would find cached.
    pub fn probe(&self, hashes: &[u64], prompt_tokens: usize) -> usize {
        self.probe_with(hashes, prompt_tokens, |_| false)
    }

    /// Like [`KvCache::probe`], counting also the blocks `coming` says will be cached before
    /// this request is prefilled.
    pub fn probe_with(
        &self,
        hashes: &[u64],
        prompt_tokens: usize,
        coming: impl Fn(u64) -> bool,
    ) -> usize {
        let leading = hashes
            .iter()
            .take_while(|&&h| self.cached.contains_key(&h) || coming(h))
            .count();
        // At least one prompt token is always computed.
        leading.min(prompt_tokens.saturating_sub(1) / self.block_size)
    }

    /// Pins the cached prefix of the prompt and enough free blocks for `total_tokens`.
    pub fn allocate(
        &mut self,
        hashes: &[u64],
        prompt_tokens: usize,
        total_tokens: usize,
    ) -> Result<Allocation, Shortage> {
        let needed = total_tokens.div_ceil(self.block_size).max(1);
        if needed > self.blocks.len() {
            return Err(Shortage::Never {
                needed,
                total: self.blocks.len(),
            });
        }
        let hit = self.probe(hashes, prompt_tokens);
        let hit_blocks: Vec<u32> = hashes[..hit].iter().map(|h| self.cached[h]).collect();
        let hits_in_free_queue = hit_blocks
            .iter()
            .filter(|&&b| self.blocks[b as usize].refs == 0)
            .count();
        if self.free - hits_in_free_queue < needed - hit {
            return Err(Shortage::Wait);
        }
        let mut blocks = hit_blocks;
        for &b in &blocks {
            if self.blocks[b as usize].refs == 0 {
                self.unlink_free(b);
            }
            self.blocks[b as usize].refs += 1;
        }
        for _ in hit..needed {
            let b = self.head;
            self.unlink_free(b);
            if let Some(old) = self.blocks[b as usize].hash.take() {
                self.cached.remove(&old);
                if let Some(events) = &mut self.events {
                    events.push(CacheEvent::Removed(old));
                }
            }
            self.blocks[b as usize].refs = 1;
            blocks.push(b);
        }
        Ok(Allocation {
            blocks,
            hit_blocks: hit,
            committed: hit,
        })
    }

    /// Registers the request's full blocks named by `hashes` (its prompt after prefill, or its
    /// whole sequence when it finishes) so later requests can reuse them. `tokens` is the
    /// sequence the hashes name (for the events).
    pub fn commit(&mut self, alloc: &mut Allocation, hashes: &[u64], tokens: &[TokenId]) {
        let upto = hashes.len().min(alloc.blocks.len());
        let mut stored: Vec<usize> = Vec::new();
        let new = alloc.blocks[..upto].iter().zip(hashes).enumerate();
        for (i, (&b, &hash)) in new.skip(alloc.committed) {
            // Another request may have computed the same block meanwhile: keep the first.
            if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
                e.insert(b);
                self.blocks[b as usize].hash = Some(hash);
                stored.push(i);
            }
        }
        alloc.committed = alloc.committed.max(upto);
        if let Some(events) = &mut self.events {
            // One event per run of consecutive new blocks, after the block before the run.
            let bs = self.block_size;
            for run in stored.chunk_by(|a, b| b == &(a + 1)) {
                let (first, last) = (run[0], run[run.len() - 1]);
                events.push(CacheEvent::Stored {
                    hashes: hashes[first..=last].to_vec(),
                    parent: first.checked_sub(1).map(|p| hashes[p]),
                    tokens: tokens
                        .get(first * bs..(last + 1) * bs)
                        .unwrap_or_default()
                        .to_vec(),
                });
            }
        }
    }

    /// Unpins the request's blocks, last block first, onto the tail of the free queue.
    pub fn release(&mut self, alloc: Allocation) {
        for &b in alloc.blocks.iter().rev() {
            let block = &mut self.blocks[b as usize];
            block.refs -= 1;
            if block.refs == 0 {
                self.push_free(b);
            }
        }
    }

    /// Forgets every cached block (pinned blocks stay pinned).
    pub fn reset(&mut self) {
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.cached.clear();
        if let Some(events) = &mut self.events {
            events.clear();
            events.push(CacheEvent::Cleared);
        }
    }

    /// Cached blocks (pinned or free).
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    fn push_free(&mut self, b: u32) {
        self.blocks[b as usize].prev = self.tail;
        self.blocks[b as usize].next = NONE;
        if self.tail == NONE {
            self.head = b;
        } else {
            self.blocks[self.tail as usize].next = b;
        }
        self.tail = b;
        self.free += 1;
    }

    fn unlink_free(&mut self, b: u32) {
        let Block { prev, next, .. } = self.blocks[b as usize];
        if prev == NONE {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NONE {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::tokenize;

    fn seq(text: &str) -> (Vec<u64>, usize) {
        let ids = tokenize(text.as_bytes());
        (block_hashes(&ids, 2), ids.len())
    }

    #[test]
    fn second_request_hits_the_first_ones_full_blocks() {
        let mut cache = KvCache::new(10, 2);
        // 9 tokens: 4 full blocks of 2, one partial.
        let (hashes, tokens) = seq("aaaabbbbccccddddeeeeffffgggghhhhi");
        assert_eq!((hashes.len(), tokens), (4, 9));
        let mut a = cache.allocate(&hashes, tokens, tokens).unwrap();
        assert_eq!(a.cached_blocks(), 0);
        cache.commit(&mut a, &hashes, &[]);
        cache.release(a);
        let b = cache.allocate(&hashes, tokens, tokens).unwrap();
        assert_eq!(b.cached_blocks(), 4);
        cache.release(b);
    }

    #[test]
    fn a_fully_cached_prompt_recomputes_its_last_block() {
        let mut cache = KvCache::new(10, 2);
        let (hashes, tokens) = seq("aaaabbbbccccdddd"); // 4 tokens, 2 full blocks
        let mut a = cache.allocate(&hashes, tokens, tokens).unwrap();
        cache.commit(&mut a, &hashes, &[]);
        cache.release(a);
        assert_eq!(cache.probe(&hashes, tokens), 1);
    }

    #[test]
    fn eviction_takes_the_least_recently_freed_tail_first() {
        let mut cache = KvCache::new(4, 2);
        // 5 tokens each: two full blocks and a partial one.
        let (a_hashes, a_tokens) = seq("aaaabbbbccccddddq");
        let (b_hashes, b_tokens) = seq("xxxxyyyyzzzzwwwwq");
        let mut a = cache.allocate(&a_hashes, a_tokens, 4).unwrap();
        cache.commit(&mut a, &a_hashes, &[]);
        cache.release(a); // free queue: a1, a0
        let mut b = cache.allocate(&b_hashes, b_tokens, 4).unwrap(); // takes the 2 never-used blocks
        cache.commit(&mut b, &b_hashes, &[]);
        cache.release(b); // free queue: a1 a0 b1 b0
        assert_eq!(cache.probe(&a_hashes, a_tokens), 2);
        // One new block evicts a's tail (a1): a keeps its first block.
        let (c_hashes, c_tokens) = seq("q");
        let c = cache.allocate(&c_hashes, c_tokens, 2).unwrap();
        assert_eq!(cache.probe(&a_hashes, a_tokens), 1);
        assert_eq!(cache.probe(&b_hashes, b_tokens), 2);
        cache.release(c);
    }

    #[test]
    fn changes_are_reported_as_vllm_reports_them() {
        let mut cache = KvCache::new(3, 2);
        cache.record_events();
        let ids = tokenize(b"aaaabbbbcccc"); // 3 tokens of 4 bytes: one full block
        let ids2 = tokenize(b"aaaabbbbccccdddd"); // 4 tokens: two full blocks
        let (h1, h2) = (block_hashes(&ids, 2), block_hashes(&ids2, 2));
        let mut a = cache.allocate(&h1, 3, 3).unwrap();
        cache.commit(&mut a, &h1, &ids);
        cache.release(a);
        let mut b = cache.allocate(&h2, 4, 4).unwrap();
        cache.commit(&mut b, &h2, &ids2);
        cache.release(b);
        assert_eq!(
            cache.take_events(),
            vec![
                CacheEvent::Stored {
                    hashes: vec![h1[0]],
                    parent: None,
                    tokens: ids[..2].to_vec()
                },
                // The first block was a hit: only the second is new, after the first.
                CacheEvent::Stored {
                    hashes: vec![h2[1]],
                    parent: Some(h2[0]),
                    tokens: ids2[2..4].to_vec()
                },
            ]
        );
        // A request of three blocks evicts both cached blocks.
        let (other, n) = seq("zzzzyyyyxxxxwwwwvvvv");
        let c = cache.allocate(&other, n, n).unwrap();
        let evicted = cache.take_events();
        assert_eq!(evicted.len(), 2);
        assert!(evicted.iter().all(|e| matches!(e, CacheEvent::Removed(_))));
        cache.release(c);
        cache.reset();
        assert_eq!(cache.take_events(), vec![CacheEvent::Cleared]);
    }

    #[test]
    fn pinned_blocks_are_never_evicted_and_shortage_is_reported() {
        let mut cache = KvCache::new(3, 2);
        let (hashes, tokens) = seq("aaaabbbbccccddddeeeeffff"); // 6 tokens, 3 full blocks
        let mut a = cache.allocate(&hashes, tokens, tokens).unwrap();
        cache.commit(&mut a, &hashes, &[]);
        assert_eq!(cache.usage(), 1.0);
        let (other, other_tokens) = seq("zz");
        assert_eq!(
            cache.allocate(&other, other_tokens, 2).unwrap_err(),
            Shortage::Wait
        );
        assert_eq!(
            cache.allocate(&other, other_tokens, 100).unwrap_err(),
            Shortage::Never {
                needed: 50,
                total: 3
            }
        );
        cache.release(a);
        assert_eq!(cache.usage(), 0.0);
        assert_eq!(cache.probe(&hashes, tokens + 1), 3);
        // The same prompt again: two blocks from the cache, the last recomputed in the block
        // at the head of the free queue (the old third block, whose hash goes).
        let again = cache.allocate(&hashes, tokens, tokens).unwrap();
        assert_eq!(again.cached_blocks(), 2);
        cache.release(again);
        assert_eq!(cache.probe(&hashes, tokens + 1), 2);
    }
}
