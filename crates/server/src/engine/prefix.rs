//! Prefix caching: the KV caches of finished sequences, kept with the token ids whose keys and
//! values they hold, so that a new request whose prompt starts with the same tokens (the history
//! of a multi-turn chat, a shared system prompt) copies those rows instead of prefilling them.
//!
//! The pool's memory counts against the engine's KV budget in [`BLOCK_TOKENS`] units, like a
//! running sequence's reservation, but it is only borrowed: whenever admission needs blocks, the
//! least recently used entries are evicted first, so a request is admitted exactly when it would
//! be without the pool. Entries are compacted to the positions they hold when they are added.
//!
//! Reuse copies rows (a memcpy of the prefix, orders of magnitude cheaper than computing it), so
//! one pooled prefix can serve any number of requests, concurrent ones included, and the pooled
//! entry never aliases a running sequence's cache. Only host caches are pooled.
//!
//! Keys include the served adapter (its unique id, `None` for the base): the same tokens under
//! another adapter have other keys and values, so an entry only serves its own adapter.

use hf2q_models::kv_cache::KvCache;

use super::BLOCK_TOKENS;

/// The shortest prefix worth reusing (one block): shorter matches are mostly the chat
/// template's first tokens, and saving them is not worth a copy.
pub(super) const MIN_REUSE: usize = BLOCK_TOKENS;

/// One finished sequence's cache.
pub(super) struct Entry {
    /// The tokens whose keys and values `cache` holds, in order (prompt, then generated tokens
    /// that were fed back).
    pub tokens: Vec<u32>,
    pub cache: KvCache,
    /// The served adapter whose forward made the cache (its unique id; `None`: the base).
    pub adapter: Option<u64>,
    /// Budget blocks the entry holds.
    pub blocks: usize,
    /// Unique id (stable while other entries come and go).
    pub id: u64,
    /// Logical time of the last use (insertion or a hit): eviction takes the smallest.
    used: u64,
}

/// The pool of finished sequences' caches.
#[derive(Default)]
pub(super) struct PrefixPool {
    entries: Vec<Entry>,
    blocks: usize,
    bytes: usize,
    clock: u64,
}

/// Length of the common prefix of `a` and `b`.
pub(super) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How many of `prompt`'s tokens a source holding `common` of them may give: at least one prompt
/// token must still be fed (its logits start the generation), and less than [`MIN_REUSE`] is
/// not worth it (0 = no reuse).
pub(super) fn usable(common: usize, prompt: usize) -> usize {
    let n = common.min(prompt.saturating_sub(1));
    if n >= MIN_REUSE {
        n
    } else {
        0
    }
}

impl PrefixPool {
    /// Budget blocks held by all entries.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// Bytes of KV memory held by all entries.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The entry of `adapter` sharing the longest usable prefix with `prompt`: (entry id,
    /// tokens to reuse).
    pub fn best(&self, prompt: &[u32], adapter: Option<u64>) -> Option<(u64, usize)> {
        let mut best: Option<(u64, usize)> = None;
        for e in self.entries.iter().filter(|e| e.adapter == adapter) {
            let n = usable(common_prefix(&e.tokens, prompt), prompt.len());
            if n > 0 && best.is_none_or(|b| n > b.1) {
                best = Some((e.id, n));
            }
        }
        best
    }

    pub fn get(&self, id: u64) -> Option<&Entry> {
        self.entries.iter().find(|e| e.id == id)
    }

    /// Marks an entry as just used.
    pub fn touch(&mut self, id: u64) {
        self.clock += 1;
        let now = self.clock;
        if let Some(e) = self.entries.iter_mut().find(|e| e.id == id) {
            e.used = now;
        }
    }

    /// Removes an entry and returns it (its blocks leave the pool's count).
    pub fn take(&mut self, id: u64) -> Option<Entry> {
        let i = self.entries.iter().position(|e| e.id == id)?;
        let e = self.entries.swap_remove(i);
        self.blocks -= e.blocks;
        self.bytes -= e.cache.bytes();
        Some(e)
    }

    /// Evicts least recently used entries, never `keep`, until `free` (blocks free outside the
    /// pool, updated in place) reaches `need` or nothing else is left to evict. Returns how many
    /// entries were evicted.
    pub fn evict(&mut self, need: usize, free: &mut usize, keep: Option<u64>) -> usize {
        let mut n = 0;
        while *free < need {
            let victim = self
                .entries
                .iter()
                .filter(|e| Some(e.id) != keep)
                .min_by_key(|e| e.used)
                .map(|e| e.id);
            let Some(id) = victim else { break };
            let e = self.take(id).expect("the victim is in the pool");
            *free += e.blocks;
            n += 1;
        }
        n
    }

    /// Drops every entry of `adapter` (unloaded); returns the blocks that left the pool.
    pub fn drop_adapter(&mut self, adapter: u64) -> usize {
        let ids: Vec<u64> = self
            .entries
            .iter()
            .filter(|e| e.adapter == Some(adapter))
            .map(|e| e.id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.take(id))
            .map(|e| e.blocks)
            .sum()
    }

    /// Adds a finished sequence's cache holding `tokens` (already compacted to them) made with
    /// `adapter`, which holds `blocks` budget blocks. An entry whose tokens are a prefix of the new one's is
    /// redundant (every match it gives, the new one gives too) and is dropped; if an existing
    /// entry already covers the new one, that one is kept instead. Returns the blocks that left
    /// the pool (the dropped entries', or the new one's when it was not kept).
    pub fn insert(
        &mut self,
        tokens: Vec<u32>,
        cache: KvCache,
        blocks: usize,
        adapter: Option<u64>,
    ) -> usize {
        self.clock += 1;
        let now = self.clock;
        if let Some(e) = self.entries.iter_mut().find(|e| {
            e.adapter == adapter && e.tokens.len() >= tokens.len() && e.tokens.starts_with(&tokens)
        }) {
            e.used = now;
            return blocks;
        }
        let (mut freed, mut freed_bytes) = (0, 0);
        self.entries.retain(|e| {
            let redundant = e.adapter == adapter && tokens.starts_with(&e.tokens);
            if redundant {
                freed += e.blocks;
                freed_bytes += e.cache.bytes();
            }
            !redundant
        });
        self.blocks = self.blocks - freed + blocks;
        self.bytes = self.bytes - freed_bytes + cache.bytes();
        self.entries.push(Entry {
            tokens,
            cache,
            adapter,
            blocks,
            id: now,
            used: now,
        });
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache() -> KvCache {
        KvCache::new(1, 1, 1, 64, hf2q_models::kv_cache::KvType::F16)
    }
    fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
        r.collect()
    }

    #[test]
    fn usable_lengths() {
        assert_eq!(usable(40, 100), 40);
        assert_eq!(usable(40, 40), 39, "one prompt token is always fed");
        assert_eq!(usable(15, 100), 0, "below one block");
        assert_eq!(usable(16, 16), 0);
        assert_eq!(usable(16, 17), 16);
    }

    #[test]
    fn best_match_and_dedup() {
        let mut p = PrefixPool::default();
        assert_eq!(p.insert(toks(0..20), cache(), 2, None), 0);
        // A longer sequence with the same start replaces it.
        assert_eq!(p.insert(toks(0..40), cache(), 3, None), 2);
        assert_eq!((p.len(), p.blocks()), (1, 3));
        // One that the pool already covers is not added.
        assert_eq!(p.insert(toks(0..30), cache(), 2, None), 2);
        assert_eq!((p.len(), p.blocks()), (1, 3));
        let mut other = toks(0..18);
        other.extend(100..130);
        p.insert(other.clone(), cache(), 3, None);
        assert_eq!(p.len(), 2);
        let mut prompt = toks(0..25);
        prompt.push(7);
        let (id, n) = p.best(&prompt, None).unwrap();
        assert_eq!(n, 25);
        assert_eq!(p.get(id).unwrap().tokens.len(), 40);
        let (id2, n2) = p.best(&other[..28], None).unwrap();
        assert_eq!((n2, p.get(id2).unwrap().tokens[20]), (27, 102));
        assert!(p.best(&toks(50..90), None).is_none());
        assert!(p.best(&toks(0..10), None).is_none());
    }

    #[test]
    fn entries_serve_only_their_adapter() {
        let mut p = PrefixPool::default();
        p.insert(toks(0..40), cache(), 3, Some(7));
        assert!(p.best(&toks(0..30), None).is_none());
        assert!(p.best(&toks(0..30), Some(8)).is_none());
        assert_eq!(p.best(&toks(0..30), Some(7)).unwrap().1, 29);
        // The same tokens under another adapter are another entry, not redundant.
        assert_eq!(p.insert(toks(0..20), cache(), 2, None), 0);
        assert_eq!(p.insert(toks(0..60), cache(), 4, Some(9)), 0);
        assert_eq!((p.len(), p.blocks()), (3, 9));
        assert_eq!(p.drop_adapter(7), 3);
        assert_eq!((p.len(), p.blocks()), (2, 6));
        assert!(p.best(&toks(0..30), Some(7)).is_none());
    }

    #[test]
    fn eviction_is_lru_and_spares_the_source() {
        let mut p = PrefixPool::default();
        p.insert(toks(0..20), cache(), 2, None);
        p.insert(toks(100..120), cache(), 2, None);
        p.insert(toks(200..220), cache(), 2, None);
        let (a, _) = p.best(&toks(0..30), None).unwrap();
        let (b, _) = p.best(&toks(100..130), None).unwrap();
        p.touch(a); // b is now the least recently used, then c, then a.
        let mut free = 1;
        assert_eq!(p.evict(3, &mut free, None), 1);
        assert!(p.get(b).is_none());
        assert_eq!((free, p.blocks()), (3, 4));
        // Spare a even though more is needed than the others hold.
        let mut free = 0;
        assert_eq!(p.evict(10, &mut free, Some(a)), 1);
        assert_eq!((free, p.len(), p.blocks()), (2, 1, 2));
        assert!(p.get(a).is_some());
        assert_eq!(p.take(a).unwrap().blocks, 2);
        assert_eq!((p.len(), p.blocks()), (0, 0));
    }
}
