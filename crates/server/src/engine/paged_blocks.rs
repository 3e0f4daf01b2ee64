//! The scheduler's block operations with the paged KV cache (`serve --kv-paged`) and its prefix
//! cache: admitting a sequence (the cached blocks of its leading tokens shared, the rest taken
//! from the pool, cached blocks no table holds evicted to make room), registering the blocks a
//! step filled, and releasing a leaving sequence's table.
//!
//! The prefix cache itself (keys, reference counts, eviction order) is
//! `hf2q_tensor::paged_prefix`; when to preempt is [`super::preempt`]'s. With prefix caching off
//! (`EngineConfig::prefix_cache`), `prefix` is `None` and admission takes every block fresh.
//!
//! What a sequence gets from the cache: its first `k` full blocks when they hold its first
//! `k * B` tokens (prompt, and for a readmitted sequence the tokens it generated), at most all
//! its tokens but one (the last fed token's logits start, or continue, its generation). It then
//! prefills from position `k * B` on, as a chunked prefill would.

use hf2q_tensor::paged::{BlockPool, BlockTable};
use hf2q_tensor::paged_prefix::PrefixBlocks;

use super::preempt::watermark;

/// A sequence's blocks at admission: its table covers all its tokens, the first `shared` blocks
/// from the prefix cache.
pub(super) struct Admitted {
    pub table: BlockTable,
    pub shared: usize,
}

/// Blocks for a sequence with `tokens` to feed under `adapter`, when they and the watermark
/// ([`watermark`], waived when nothing runs) can be had: the cached prefix's blocks shared, the
/// rest free or freed by evicting cached blocks no table holds. `None` leaves everything as it
/// was (the sequence waits).
pub(super) fn admit(
    pool: &mut BlockPool,
    mut prefix: Option<&mut PrefixBlocks>,
    tokens: &[u32],
    adapter: Option<u64>,
    nothing_running: bool,
) -> Option<Admitted> {
    let b = pool.block_tokens();
    let max_shared = tokens.len().saturating_sub(1) / b;
    let shared = prefix
        .as_deref()
        .map_or_else(Vec::new, |c| c.lookup(tokens, adapter, max_shared));
    let need = pool.blocks_for(tokens.len()) - shared.len();
    let keep = if nothing_running { 0 } else { watermark(pool) };
    if need + keep > pool.free_blocks() {
        // Cached blocks no table holds count as free, except the ones this sequence will hold.
        let evictable = prefix.as_deref().map_or(0, |c| {
            let own = shared.iter().filter(|&&id| pool.refs(id) == 1).count();
            c.evictable(pool) - own
        });
        if need + keep > pool.free_blocks() + evictable {
            return None;
        }
    }
    let mut table = BlockTable::new();
    table.share(pool, &shared);
    if let Some(c) = prefix.as_deref_mut() {
        c.touch_chain(&shared);
        if need > pool.free_blocks() {
            c.evict(pool, need - pool.free_blocks());
        }
    }
    if table.reserve(pool, tokens.len()).is_err() {
        // Not expected (the blocks were counted above): leave nothing held.
        release(&mut table, pool, prefix);
        return None;
    }
    Some(Admitted {
        table,
        shared: shared.len(),
    })
}

/// Lets a sequence still prefilling share blocks cached since it was admitted (a request that
/// arrived with others starting with the same tokens: the first computes them, the others take
/// its blocks as they fill instead of computing them beside it). Applies while everything the
/// sequence wrote is its cached chain (`pos == shared * B`): each next full block of `tokens`
/// found after its chain replaces the unwritten block the table reserved there. Never the block
/// of its last token (whose logits it needs). Returns the blocks it took.
pub(super) fn share_more(
    pool: &mut BlockPool,
    prefix: &mut PrefixBlocks,
    table: &mut BlockTable,
    tokens: &[u32],
    adapter: Option<u64>,
    pos: &mut usize,
    shared: &mut usize,
) -> usize {
    let b = pool.block_tokens();
    let max_shared = tokens.len().saturating_sub(1) / b;
    let mut took = 0;
    while *pos == *shared * b && *shared < max_shared && *shared <= table.blocks().len() {
        let k = *shared;
        let parent = k.checked_sub(1).map(|p| table.blocks()[p]);
        let Some(id) = prefix.find(parent, adapter, &tokens[k * b..(k + 1) * b]) else {
            break;
        };
        if table.blocks().get(k) != Some(&id) {
            table.put_shared(pool, k, id);
        }
        prefix.touch_chain(&[id]);
        *shared += 1;
        *pos += b;
        took += 1;
    }
    took
}

/// Frees cached blocks no table holds until `pool` has `need` free ones, when it can.
pub(super) fn make_room(pool: &mut BlockPool, prefix: Option<&mut PrefixBlocks>, need: usize) {
    if let Some(c) = prefix {
        if need > pool.free_blocks() {
            c.evict(pool, need - pool.free_blocks());
        }
    }
}

/// Registers the full blocks of a sequence whose first `tokens.len()` positions are written
/// (after a successful step), from its block `shared` on. Returns how many of its leading blocks
/// are cached now.
pub(super) fn register(
    pool: &mut BlockPool,
    prefix: Option<&mut PrefixBlocks>,
    table: &BlockTable,
    tokens: &[u32],
    adapter: Option<u64>,
    shared: usize,
) -> usize {
    match prefix {
        Some(c) => c.register(pool, table.blocks(), tokens, adapter, shared),
        None => 0,
    }
}

/// Releases a leaving (finished or preempted) sequence's table: its cached blocks stay in the
/// prefix cache, touched from its end to its start; the others go back to the pool.
pub(super) fn release(
    table: &mut BlockTable,
    pool: &mut BlockPool,
    prefix: Option<&mut PrefixBlocks>,
) {
    if let Some(c) = prefix {
        c.touch_chain(table.blocks());
    }
    table.clear(pool);
}

/// Blocks held by sequences: the pool's used blocks less those only the prefix cache holds.
pub(super) fn held(pool: &BlockPool, prefix: Option<&PrefixBlocks>) -> usize {
    pool.used_blocks() - prefix.map_or(0, |c| c.evictable(pool))
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: usize = 4;

    #[test]
    fn admission_shares_the_cached_prefix_and_leaves_one_token_to_feed() {
        let mut pool = BlockPool::new(32, B).unwrap();
        let mut cache = PrefixBlocks::new(B);
        let prompt: Vec<u32> = (0..12).collect();
        let mut first = admit(&mut pool, Some(&mut cache), &prompt, None, true).unwrap();
        assert_eq!(first.shared, 0);
        assert_eq!(
            register(&mut pool, Some(&mut cache), &first.table, &prompt, None, 0),
            3
        );
        release(&mut first.table, &mut pool, Some(&mut cache));
        assert_eq!(held(&pool, Some(&cache)), 0, "only the cache holds them");

        // The same 12 tokens: 2 blocks shared, the last token fed again in a fresh block.
        let again = admit(&mut pool, Some(&mut cache), &prompt, None, true).unwrap();
        assert_eq!(again.shared, 2);
        assert_eq!(again.table.blocks().len(), 3);
        let mut longer = prompt.clone();
        longer.extend([7, 7]);
        let l = admit(&mut pool, Some(&mut cache), &longer, None, false).unwrap();
        assert_eq!(l.shared, 3, "all three blocks, two tokens left to feed");
        assert_eq!(l.table.blocks()[..3], cache.lookup(&prompt, None, 3)[..]);
        assert_eq!(l.table.blocks()[..2], again.table.blocks()[..2]);
        assert!(
            admit(&mut pool, Some(&mut cache), &prompt, Some(1), false)
                .is_some_and(|a| a.shared == 0),
            "another adapter shares nothing"
        );
        // A sequence admitted before the blocks it starts with were cached takes them as they
        // come (its twin, admitted beside it, computed them).
        let mut late = admit(
            &mut pool,
            Some(&mut cache),
            &[90, 91, 92, 93, 94],
            None,
            false,
        )
        .unwrap();
        let mut twin = admit(
            &mut pool,
            Some(&mut cache),
            &[90, 91, 92, 93, 94],
            None,
            false,
        )
        .unwrap();
        let toks = [90, 91, 92, 93, 94];
        assert_eq!(
            register(&mut pool, Some(&mut cache), &late.table, &toks, None, 0),
            1
        );
        let (mut pos, mut shared) = (0, 0);
        let took = share_more(
            &mut pool,
            &mut cache,
            &mut twin.table,
            &toks,
            None,
            &mut pos,
            &mut shared,
        );
        assert_eq!((took, pos, shared), (1, 4, 1));
        assert_eq!(twin.table.blocks()[0], late.table.blocks()[0]);
        assert_eq!(
            pool.refs(late.table.blocks()[0]),
            3,
            "two tables and the cache"
        );
        assert_eq!(
            twin.table.blocks().len(),
            2,
            "its last token's block stays its own"
        );
        release(&mut late.table, &mut pool, Some(&mut cache));
        release(&mut twin.table, &mut pool, Some(&mut cache));
        // Caching off: nothing shared.
        assert_eq!(
            admit(&mut pool, None, &prompt, None, false).unwrap().shared,
            0
        );
    }

    #[test]
    fn admission_keeps_the_watermark_back_unless_nothing_runs() {
        let mut pool = BlockPool::new(250, 16).unwrap();
        assert_eq!(watermark(&pool), 2, "1 % of 250 blocks");
        assert_eq!(
            watermark(&BlockPool::new(20, 16).unwrap()),
            1,
            "at least one"
        );
        let _held = pool.alloc(240).unwrap();
        // 10 free: an 8-block prompt leaves the 2 kept back, a 9-block one would not.
        let prompt = |blocks: usize, extra: usize| vec![7u32; blocks * 16 + extra];
        assert!(admit(&mut pool, None, &prompt(9, 0), None, false).is_none());
        assert_eq!(pool.free_blocks(), 10, "a refusal takes nothing");
        assert!(admit(&mut pool, None, &prompt(10, 1), None, true).is_none());
        let mut a = admit(&mut pool, None, &prompt(8, 0), None, false).unwrap();
        release(&mut a.table, &mut pool, None);
        let b = admit(&mut pool, None, &prompt(10, 0), None, true);
        assert!(b.is_some(), "no watermark when nothing runs");
    }

    #[test]
    fn admission_evicts_unheld_cached_blocks_but_never_its_own_prefix() {
        let mut pool = BlockPool::new(8, B).unwrap();
        let mut cache = PrefixBlocks::new(B);
        // Two finished sequences leave 6 cached blocks; 2 are free.
        for base in [0u32, 100] {
            let toks: Vec<u32> = (base..base + 12).collect();
            let mut a = admit(&mut pool, Some(&mut cache), &toks, None, true).unwrap();
            register(&mut pool, Some(&mut cache), &a.table, &toks, None, 0);
            release(&mut a.table, &mut pool, Some(&mut cache));
        }
        assert_eq!((pool.free_blocks(), cache.len()), (2, 6));
        // 0..12 plus 12 more tokens: 3 shared, 3 new from 2 free + 1 evicted (the other
        // sequence's end).
        let toks: Vec<u32> = (0..12).chain(200..212).collect();
        let a = admit(&mut pool, Some(&mut cache), &toks, None, true).unwrap();
        assert_eq!(a.shared, 3);
        assert_eq!(a.table.blocks().len(), 6);
        assert_eq!(
            cache.lookup(&(100..112).collect::<Vec<_>>(), None, 8).len(),
            2
        );
        // Nothing more fits: 8 blocks, 6 held, 2 cached; a 3-block request waits.
        let other: Vec<u32> = (300..312).collect();
        assert!(admit(&mut pool, Some(&mut cache), &other, None, true).is_none());
        assert_eq!(pool.free_blocks(), 0, "a refusal takes nothing");
        assert!(admit(&mut pool, Some(&mut cache), &other[..8], None, true).is_some());
    }
}
