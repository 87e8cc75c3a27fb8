//! One server's eviction order: its entries grouped by `last_used`, oldest group first.
//!
//! A notify stamps all of a request's prefixes with one time, so a group usually holds a whole
//! request: one B-tree operation per notify instead of one per chunk, and 12 bytes per entry.

use std::collections::BTreeMap;

use crate::Tick;

/// An entry as the eviction order sees it (packed: 12 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C, packed(4))]
pub(super) struct LruEntry {
    depth: u32,
    hash: u64,
}

impl LruEntry {
    pub fn new(depth: u32, hash: u64) -> Self {
        Self { depth, hash }
    }

    pub fn hash(self) -> u64 {
        self.hash
    }

    pub fn depth(self) -> u32 {
        self.depth
    }

    /// Ascending order is the reverse of eviction order within one `last_used`: the entry to
    /// evict first (deepest, then lowest hash) sits at the end of its group.
    fn keep_order(self) -> (u32, u64) {
        (self.depth, !self.hash)
    }
}

pub(super) struct Lru {
    pub capacity: u64,
    len: u64,
    /// last_used (ms) -> its entries, sorted by [`LruEntry::keep_order`].
    groups: BTreeMap<u64, Vec<LruEntry>>,
}

impl Lru {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            len: 0,
            groups: BTreeMap::new(),
        }
    }

    /// Entries held.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Records one notify at `t`: `moved` are refreshed entries with the older `last_used` they
    /// leave (reordered here), `touched` is every entry that now has `last_used = t`, in depth
    /// order (the moved ones and the new ones).
    pub fn touch(&mut self, t: Tick, moved: &mut [(u64, LruEntry)], touched: &[LruEntry]) {
        moved.sort_unstable_by_key(|&(old, e)| (old, e.keep_order()));
        for group in moved.chunk_by(|a, b| a.0 == b.0) {
            let Some(entries) = self.groups.get_mut(&group[0].0) else {
                continue;
            };
            let before = entries.len();
            let mut leaving = group.iter().map(|&(_, e)| e.keep_order()).peekable();
            entries.retain(|e| {
                let key = e.keep_order();
                while leaving.next_if(|&l| l < key).is_some() {}
                leaving.next_if_eq(&key).is_none()
            });
            self.len -= (before - entries.len()) as u64;
            if entries.is_empty() {
                self.groups.remove(&group[0].0);
            } else if entries.len() * 4 < entries.capacity() {
                entries.shrink_to_fit();
            }
        }
        if touched.is_empty() {
            return;
        }
        let entries = self.groups.entry(t.millis()).or_default();
        let sorted = entries.is_empty();
        entries.reserve_exact(touched.len());
        entries.extend_from_slice(touched);
        if !sorted {
            entries.sort_unstable_by_key(|e| e.keep_order());
        }
        self.len += touched.len() as u64;
    }

    /// Evicts until within capacity, appending the victims' hashes; returns how many.
    pub fn evict_to_capacity(&mut self, victims: &mut Vec<u64>) -> u64 {
        let mut evicted = 0;
        while self.len > self.capacity {
            let mut oldest = self.groups.first_entry().expect("len counts group entries");
            let entries = oldest.get_mut();
            let take = entries.len().min((self.len - self.capacity) as usize);
            victims.extend(
                entries
                    .drain(entries.len() - take..)
                    .rev()
                    .map(LruEntry::hash),
            );
            if entries.is_empty() {
                oldest.remove();
            }
            self.len -= take as u64;
            evicted += take as u64;
        }
        evicted
    }

    /// Removes every entry last used before `cutoff`, appending the hashes; returns how many.
    pub fn purge_before(&mut self, cutoff: Tick, victims: &mut Vec<u64>) -> u64 {
        let mut purged = 0;
        while let Some(oldest) = self.groups.first_entry() {
            if *oldest.key() >= cutoff.millis() {
                break;
            }
            let entries = oldest.remove();
            purged += entries.len() as u64;
            victims.extend(entries.into_iter().map(LruEntry::hash));
        }
        self.len -= purged;
        purged
    }

    /// Every entry with its `last_used` (ms), oldest group first.
    pub fn iter(&self) -> impl Iterator<Item = (u64, LruEntry)> + '_ {
        self.groups
            .iter()
            .flat_map(|(&t, entries)| entries.iter().map(move |&e| (t, e)))
    }

    /// Removes everything, appending the hashes.
    pub fn clear(&mut self, victims: &mut Vec<u64>) {
        for entries in std::mem::take(&mut self.groups).into_values() {
            victims.extend(entries.into_iter().map(LruEntry::hash));
        }
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(lru: &mut Lru, t: u64, entries: &[(u32, u64)]) {
        let touched: Vec<_> = entries.iter().map(|&(d, h)| LruEntry::new(d, h)).collect();
        lru.touch(Tick::from_millis(t), &mut [], &touched);
    }

    #[test]
    fn evicts_oldest_then_deepest_then_lowest_hash() {
        let mut lru = Lru::new(10);
        request(&mut lru, 5, &[(1, 10), (2, 20), (3, 30)]);
        request(&mut lru, 1, &[(1, 40), (2, 50)]);
        request(&mut lru, 5, &[(1, 60), (3, 7)]);
        lru.capacity = 0;
        let mut victims = Vec::new();
        assert_eq!(lru.evict_to_capacity(&mut victims), 7);
        assert_eq!(victims, vec![50, 40, 7, 30, 20, 10, 60]);
        assert_eq!(lru.len(), 0);
    }

    #[test]
    fn moved_entries_leave_their_old_group() {
        let mut lru = Lru::new(10);
        request(&mut lru, 1, &[(1, 10), (2, 20), (3, 30)]);
        let mut moved = [(1, LruEntry::new(1, 10)), (1, LruEntry::new(2, 20))];
        lru.touch(
            Tick::from_millis(2),
            &mut moved,
            &[LruEntry::new(1, 10), LruEntry::new(2, 20)],
        );
        assert_eq!(lru.len(), 3);
        let mut victims = Vec::new();
        lru.capacity = 1;
        lru.evict_to_capacity(&mut victims);
        assert_eq!(victims, vec![30, 20]);
        let mut rest = Vec::new();
        assert_eq!(lru.purge_before(Tick::from_millis(3), &mut rest), 1);
        assert_eq!(rest, vec![10]);
    }
}
