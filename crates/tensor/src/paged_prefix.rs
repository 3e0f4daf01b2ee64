//! Prefix caching for the paged KV cache: full blocks kept after their sequence is gone, found
//! again by the tokens they hold, and shared by reference count (vLLM's automatic prefix
//! caching, SGLang's radix cache).
//!
//! A block joins the cache once all its `B` positions are written ([`PrefixBlocks::register`]).
//! It is keyed by its parent (the cached block before it in the same sequence; none for a
//! sequence's first block), the adapter whose forward wrote it, and its `B` token ids, so a key
//! names the whole token prefix up to the block's end without hashing it: a chain of lookups from
//! the first block ([`PrefixBlocks::lookup`]) finds exactly the blocks whose keys and values a
//! new sequence with the same leading tokens would compute. The cache holds one reference on each
//! of its blocks ([`BlockPool::retain`]); a sequence that starts from a cached prefix shares the
//! blocks (`BlockTable::share`), and never writes them (only full blocks are shared, and at least
//! one prompt token is always left to feed, whose logits start the generation).
//!
//! Invariants:
//! - every cached block's parent is cached, and a table holding a cached block holds its whole
//!   chain of ancestors before it, so an ancestor is held at least as often as its descendants;
//! - a block only the cache holds (`refs == 1`) is evictable; [`PrefixBlocks::evict`] frees the
//!   least recently used first, and evicting a block unregisters its descendants too (none is held
//!   by a table, by the first invariant), so that no key ever names a parent whose id was reused;
//! - recency: a hit touches the shared blocks; a sequence that finishes or is preempted touches
//!   its chain tail first ([`PrefixBlocks::touch_chain`]), so a chain is evicted from its end and
//!   its shared start stays longest.
//!
//! What it is not: which sequence to admit or preempt (the scheduler's), or the per-request
//! caches' prefix pool (copies of whole caches, the server's `engine::prefix`). Blocks are
//! compared by token ids only: the keys and values of the same ids under the same adapter are the
//! same rows wherever the step's arithmetic does not depend on the batch (the CPU), and on a GPU
//! they differ as much as any batched step's rows do.

use std::collections::{BTreeSet, HashMap};

use crate::paged::{BlockId, BlockPool};

/// What a cached block holds: the token ids of its `B` positions after its parent's.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    /// The cached block before it in its sequence (`None`: the sequence's first block).
    parent: Option<BlockId>,
    /// The served adapter whose forward wrote it (its unique id; `None`: the base model).
    adapter: Option<u64>,
    tokens: Box<[u32]>,
}

/// One cached block.
#[derive(Debug)]
struct Entry {
    key: Key,
    /// Cached blocks whose parent this is.
    children: Vec<BlockId>,
    /// Logical time of the last use (registration, a hit, its sequence leaving).
    used: u64,
}

/// The cached blocks of one paged KV cache's pool.
#[derive(Debug)]
pub struct PrefixBlocks {
    block_tokens: usize,
    by_key: HashMap<Key, BlockId>,
    entries: HashMap<BlockId, Entry>,
    /// Every cached block by last use, oldest first.
    lru: BTreeSet<(u64, BlockId)>,
    clock: u64,
}

impl PrefixBlocks {
    /// An empty cache for a pool of blocks of `block_tokens` positions.
    pub fn new(block_tokens: usize) -> PrefixBlocks {
        PrefixBlocks {
            block_tokens: block_tokens.max(1),
            by_key: HashMap::new(),
            entries: HashMap::new(),
            lru: BTreeSet::new(),
            clock: 0,
        }
    }

    /// Blocks in the cache (shared with sequences or not).
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Whether `id` is in the cache.
    pub fn contains(&self, id: BlockId) -> bool {
        self.entries.contains_key(&id)
    }

    /// Cached blocks no table holds: free for the taking ([`PrefixBlocks::evict`]).
    pub fn evictable(&self, pool: &BlockPool) -> usize {
        self.entries.keys().filter(|&&b| pool.refs(b) == 1).count()
    }

    /// The longest chain of cached blocks holding `tokens`' first positions under `adapter`, at
    /// most `max_blocks` of them (the caller leaves the positions it must still feed). Looks
    /// only; [`PrefixBlocks::hit`] records the use once the blocks are shared.
    pub fn lookup(&self, tokens: &[u32], adapter: Option<u64>, max_blocks: usize) -> Vec<BlockId> {
        let b = self.block_tokens;
        let mut chain: Vec<BlockId> = Vec::new();
        for block in tokens.chunks_exact(b).take(max_blocks) {
            match self.find(chain.last().copied(), adapter, block) {
                Some(id) => chain.push(id),
                None => break,
            }
        }
        chain
    }

    /// The cached block holding `tokens` (one block's worth) after the cached block `parent`
    /// (`None`: a sequence's first block) under `adapter`: one step of [`PrefixBlocks::lookup`],
    /// for a sequence extending a chain it already shares.
    pub fn find(
        &self,
        parent: Option<BlockId>,
        adapter: Option<u64>,
        tokens: &[u32],
    ) -> Option<BlockId> {
        let key = Key {
            parent,
            adapter,
            tokens: tokens.into(),
        };
        self.by_key.get(&key).copied()
    }

    /// Records a use of `chain` (a table's blocks, in position order): a new sequence sharing it
    /// (a hit), or the sequence holding it leaving: its cached blocks are touched from the last to the first, so the chain's end is
    /// evicted before its start.
    pub fn touch_chain(&mut self, chain: &[BlockId]) {
        for &id in chain.iter().rev() {
            if let Some(e) = self.entries.get_mut(&id) {
                self.lru.remove(&(e.used, id));
                self.clock += 1;
                e.used = self.clock;
                self.lru.insert((e.used, id));
            }
        }
    }

    /// Registers the full blocks of a sequence whose table is `table` and whose first
    /// `tokens.len()` positions are written, from its block `from` on (blocks before `from` are
    /// cached already: shared at admission or registered by an earlier call). Each newly cached
    /// block is retained once in `pool`. Returns how many of the table's leading blocks are now
    /// cached: registration stops at a block whose contents another block already holds (a
    /// sequence that computed the same prefix beside it; its own copy stays private, and so do
    /// the blocks after it, whose parent is not cached).
    pub fn register(
        &mut self,
        pool: &mut BlockPool,
        table: &[BlockId],
        tokens: &[u32],
        adapter: Option<u64>,
        from: usize,
    ) -> usize {
        let b = self.block_tokens;
        let full = (tokens.len() / b).min(table.len());
        let mut k = from;
        while k < full {
            let id = table[k];
            let parent = k.checked_sub(1).map(|p| table[p]);
            if parent.is_some_and(|p| !self.entries.contains_key(&p)) {
                break;
            }
            let key = Key {
                parent,
                adapter,
                tokens: tokens[k * b..(k + 1) * b].into(),
            };
            match self.by_key.get(&key) {
                Some(&cached) if cached == id => {}
                Some(_) => break,
                None if self.entries.contains_key(&id) => break,
                None => {
                    pool.retain(id);
                    self.clock += 1;
                    if let Some(p) = parent {
                        if let Some(e) = self.entries.get_mut(&p) {
                            e.children.push(id);
                        }
                    }
                    self.by_key.insert(key.clone(), id);
                    self.lru.insert((self.clock, id));
                    self.entries.insert(
                        id,
                        Entry {
                            key,
                            children: Vec::new(),
                            used: self.clock,
                        },
                    );
                }
            }
            k += 1;
        }
        k
    }

    /// Frees at least `n` blocks into `pool` if that many are evictable, least recently used
    /// first (each with its cached descendants, which no table holds either). Returns the blocks
    /// freed (fewer than `n` when the cache runs out of blocks no table holds).
    pub fn evict(&mut self, pool: &mut BlockPool, n: usize) -> usize {
        let mut freed = 0;
        while freed < n {
            let Some(&(_, id)) = self.lru.iter().find(|&&(_, id)| pool.refs(id) == 1) else {
                break;
            };
            freed += self.unregister(pool, id);
        }
        freed
    }

    /// Takes out every block written under `adapter` (an unloaded adapter, whose unique id no
    /// request names again), releasing the cache's references. Returns the blocks freed.
    pub fn drop_adapter(&mut self, pool: &mut BlockPool, adapter: u64) -> usize {
        let roots: Vec<BlockId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.key.parent.is_none() && e.key.adapter == Some(adapter))
            .map(|(&id, _)| id)
            .collect();
        roots.into_iter().map(|id| self.unregister(pool, id)).sum()
    }

    /// Empties the cache, releasing its references. Returns the blocks freed.
    pub fn clear(&mut self, pool: &mut BlockPool) -> usize {
        let before = pool.free_blocks();
        for (id, _) in self.entries.drain() {
            pool.release(id);
        }
        self.by_key.clear();
        self.lru.clear();
        pool.free_blocks() - before
    }

    /// Takes `id` and its descendants out of the cache, releasing the cache's reference on each.
    /// Returns how many of them that freed.
    fn unregister(&mut self, pool: &mut BlockPool, id: BlockId) -> usize {
        let mut freed = 0;
        let mut stack = vec![id];
        if let Some(p) = self.entries.get(&id).and_then(|e| e.key.parent) {
            if let Some(pe) = self.entries.get_mut(&p) {
                pe.children.retain(|&c| c != id);
            }
        }
        while let Some(b) = stack.pop() {
            let Some(e) = self.entries.remove(&b) else {
                continue;
            };
            self.by_key.remove(&e.key);
            self.lru.remove(&(e.used, b));
            stack.extend(e.children);
            pool.release(b);
            if pool.refs(b) == 0 {
                freed += 1;
            }
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paged::BlockTable;

    const B: usize = 4;

    /// A sequence that wrote `tokens` into freshly taken blocks, registered.
    fn written(
        pool: &mut BlockPool,
        cache: &mut PrefixBlocks,
        tokens: &[u32],
        adapter: Option<u64>,
    ) -> BlockTable {
        let mut t = BlockTable::new();
        t.reserve(pool, tokens.len()).unwrap();
        let n = cache.register(pool, t.blocks(), tokens, adapter, 0);
        assert_eq!(n, tokens.len() / B, "every full block registered");
        t
    }

    #[test]
    fn full_blocks_are_found_again_by_their_tokens_and_adapter() {
        let mut pool = BlockPool::new(16, B).unwrap();
        let mut cache = PrefixBlocks::new(B);
        let a: Vec<u32> = (0..10).collect();
        let mut t = written(&mut pool, &mut cache, &a, None);
        assert_eq!(
            cache.len(),
            2,
            "10 positions: 2 full blocks, the third partial"
        );
        assert_eq!(pool.refs(t.blocks()[0]), 2, "the table and the cache");
        assert_eq!(pool.refs(t.blocks()[2]), 1, "a partial block is not cached");

        // Same start, different continuation: the first block only.
        let b: Vec<u32> = [0, 1, 2, 3, 9, 9, 9, 9, 9].to_vec();
        assert_eq!(cache.lookup(&b, None, 8), vec![t.blocks()[0]]);
        assert_eq!(cache.lookup(&a, None, 8), t.blocks()[..2].to_vec());
        assert_eq!(
            cache.lookup(&a, None, 1),
            t.blocks()[..1].to_vec(),
            "capped"
        );
        assert!(cache.lookup(&a, Some(7), 8).is_empty(), "another adapter");
        assert!(cache.lookup(&a[1..], None, 8).is_empty(), "shifted tokens");
        // The same block of tokens after another first block is another key.
        let c: Vec<u32> = [9, 9, 9, 9, 4, 5, 6, 7].to_vec();
        assert!(cache.lookup(&c, None, 8).is_empty());

        // The sequence leaves: its blocks stay, held by the cache alone.
        t.clear(&mut pool);
        assert_eq!(pool.free_blocks(), 14);
        assert_eq!(cache.evictable(&pool), 2);
        assert_eq!(cache.lookup(&a, None, 8).len(), 2);
    }

    #[test]
    fn a_sequence_sharing_a_prefix_registers_only_its_own_blocks() {
        let mut pool = BlockPool::new(16, B).unwrap();
        let mut cache = PrefixBlocks::new(B);
        let a: Vec<u32> = (0..8).collect();
        let first = written(&mut pool, &mut cache, &a, None);
        let mut b: Vec<u32> = (0..8).collect();
        b.extend([50, 51, 52, 53, 54]);
        let shared = cache.lookup(&b, None, (b.len() - 1) / B);
        assert_eq!(shared, first.blocks().to_vec());
        let mut t = BlockTable::new();
        t.share(&mut pool, &shared);
        cache.touch_chain(&shared);
        t.reserve(&mut pool, b.len()).unwrap();
        assert_eq!(cache.register(&mut pool, t.blocks(), &b, None, 2), 3);
        assert_eq!(cache.len(), 3);
        assert_eq!(pool.refs(shared[0]), 3, "two tables and the cache");
        assert_eq!(cache.lookup(&b, None, 8), t.blocks()[..3].to_vec());
    }

    #[test]
    fn a_duplicate_block_stays_private_and_so_do_the_blocks_after_it() {
        let mut pool = BlockPool::new(16, B).unwrap();
        let mut cache = PrefixBlocks::new(B);
        let a: Vec<u32> = (0..12).collect();
        let first = written(&mut pool, &mut cache, &a, None);
        // A twin computed beside it (admitted before the first registered anything).
        let mut twin = BlockTable::new();
        twin.reserve(&mut pool, 12).unwrap();
        assert_eq!(cache.register(&mut pool, twin.blocks(), &a, None, 0), 0);
        assert_eq!(cache.len(), 3);
        assert!(twin.blocks().iter().all(|&b| pool.refs(b) == 1));
        assert_eq!(cache.lookup(&a, None, 8), first.blocks().to_vec());
    }

    #[test]
    fn eviction_takes_unheld_blocks_least_recently_used_first_chain_ends_first() {
        let mut pool = BlockPool::new(8, B).unwrap();
        let mut cache = PrefixBlocks::new(B);
        let a: Vec<u32> = (0..12).collect();
        let b: Vec<u32> = (100..108).collect();
        let mut ta = written(&mut pool, &mut cache, &a, None);
        let mut tb = written(&mut pool, &mut cache, &b, None);
        let (a_blocks, b_blocks) = (ta.blocks().to_vec(), tb.blocks().to_vec());
        // An adapter's blocks are taken out with it.
        let c: Vec<u32> = (300..308).collect();
        let mut tc = written(&mut pool, &mut cache, &c, Some(3));
        tc.clear(&mut pool);
        assert_eq!(cache.drop_adapter(&mut pool, 3), 2);
        assert_eq!(cache.len(), 5);
        // Held blocks are never evicted.
        assert_eq!(cache.evict(&mut pool, 3), 0);
        ta.clear(&mut pool);
        cache.touch_chain(&a_blocks);
        tb.clear(&mut pool);
        cache.touch_chain(&b_blocks);
        assert_eq!(pool.free_blocks(), 3);
        // `a` left first: its end goes first, then its middle.
        assert_eq!(cache.evict(&mut pool, 2), 2);
        assert_eq!(cache.lookup(&a, None, 8), a_blocks[..1].to_vec());
        assert_eq!(cache.lookup(&b, None, 8).len(), 2);
        // A hit makes `a`'s start the most recent: `b` goes next.
        cache.touch_chain(&a_blocks[..1]);
        assert_eq!(cache.evict(&mut pool, 1), 1);
        assert_eq!(cache.lookup(&b, None, 8), b_blocks[..1].to_vec());
        assert_eq!(cache.lookup(&a, None, 8).len(), 1);
        assert_eq!(pool.free_blocks(), 6);
        assert_eq!(cache.clear(&mut pool), 2);
        assert_eq!(pool.free_blocks(), 8);
        assert!(cache.is_empty());
    }

    #[test]
    fn evicting_a_block_unregisters_its_descendants() {
        let mut pool = BlockPool::new(8, B).unwrap();
        let mut cache = PrefixBlocks::new(B);
        let a: Vec<u32> = (0..12).collect();
        let mut t = written(&mut pool, &mut cache, &a, None);
        let blocks = t.blocks().to_vec();
        t.clear(&mut pool);
        // Touch so that the first block is the oldest: evicting it takes the whole chain,
        // whose later keys name it as their parent.
        cache.touch_chain(&blocks[1..]);
        assert_eq!(cache.evict(&mut pool, 1), 3);
        assert!(cache.is_empty());
        assert_eq!(pool.free_blocks(), 8);
        // The ids come back for other contents; nothing stale is found under them.
        let b: Vec<u32> = (200..212).collect();
        let _tb = written(&mut pool, &mut cache, &b, None);
        assert!(cache.lookup(&a, None, 8).is_empty());
    }
}
