//! One shard of the memory store's index: prefix hash -> the servers holding it.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use crate::Tick;

const SLOT_BITS: u32 = 21;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
/// Servers that can be known at once (slots of dropped servers are reused).
pub const MAX_SERVERS: u32 = 1 << SLOT_BITS;
/// Marks an index value that points into the shard's holder lists instead of being a stamp.
const LIST_TAG: u64 = 1 << 63;

/// One server's hold on one prefix: `[0][last_used: 42 bits][slot: 21 bits]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub(super) struct Stamp(u64);

impl Stamp {
    pub fn new(slot: u32, tick: Tick) -> Self {
        Stamp((tick.millis() << SLOT_BITS) | u64::from(slot))
    }
    pub fn slot(self) -> u32 {
        (self.0 & SLOT_MASK) as u32
    }
    pub fn tick(self) -> Tick {
        Tick::from_millis(self.0 >> SLOT_BITS)
    }
}

/// A prefix held by one server costs one `u64` beside its key; prefixes held by several
/// servers point into `lists`.
#[derive(Default)]
pub(super) struct Shard {
    /// prefix hash -> a [`Stamp`], or `LIST_TAG | i` for `lists[i]` when 2+ servers hold it.
    index: HashMap<u64, u64, foldhash::fast::RandomState>,
    lists: Vec<Vec<Stamp>>,
    free_lists: Vec<u32>,
}

impl Shard {
    /// The servers holding `hash` (empty if none).
    #[inline]
    pub fn holders(&self, hash: u64) -> &[Stamp] {
        match self.index.get(&hash) {
            None => &[],
            Some(value) if value & LIST_TAG == 0 => {
                // SAFETY: Stamp is `repr(transparent)` over u64.
                #[allow(unsafe_code)]
                std::slice::from_ref(unsafe { &*(value as *const u64 as *const Stamp) })
            }
            Some(value) => &self.lists[(value & !LIST_TAG) as usize],
        }
    }

    /// Looks `hashes` up with independent reads, so that their cache misses overlap instead of
    /// queuing behind the dependent updates that follow (a large index lives in DRAM).
    pub fn warm(&self, hashes: &[u64]) {
        let found = hashes.iter().filter(|h| self.index.contains_key(h)).count();
        std::hint::black_box(found);
    }

    /// Stamps held in this shard (for consistency checks).
    pub fn stamps(&self) -> u64 {
        self.index
            .keys()
            .map(|&h| self.holders(h).len() as u64)
            .sum()
    }

    /// Adds or refreshes `slot`'s stamp on `hash` to `max(old, tick)`; returns the old
    /// `last_used` if there was one.
    pub fn upsert(&mut self, hash: u64, slot: u32, tick: Tick) -> Option<Tick> {
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
    pub fn remove(&mut self, hash: u64, slot: u32) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_round_trip() {
        let t = Tick::from_millis(crate::time::MAX_TICK);
        let s = Stamp::new(MAX_SERVERS - 1, t);
        assert_eq!(s.slot(), MAX_SERVERS - 1);
        assert_eq!(s.tick(), t);
        assert_eq!(s.0 & LIST_TAG, 0);
    }

    #[test]
    fn holder_lists_grow_and_shrink() {
        let mut shard = Shard::default();
        let t = Tick::from_millis(10);
        assert_eq!(shard.upsert(42, 1, t), None);
        assert_eq!(shard.upsert(42, 2, t), None);
        assert_eq!(shard.upsert(42, 3, t), None);
        assert_eq!(shard.upsert(42, 2, Tick::from_millis(20)), Some(t));
        assert_eq!(shard.holders(42).len(), 3);
        assert!(shard.remove(42, 1));
        assert!(shard.remove(42, 3));
        assert!(!shard.remove(42, 3));
        // Back to one inline stamp, the list slot freed for reuse.
        assert_eq!(shard.index[&42] & LIST_TAG, 0);
        assert_eq!(shard.free_lists.len(), 1);
        assert_eq!(shard.holders(42)[0].tick(), Tick::from_millis(20));
        assert!(shard.remove(42, 2));
        assert!(shard.index.is_empty());
        assert!(shard.holders(42).is_empty());
    }
}
