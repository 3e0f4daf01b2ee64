//! The engine's KV bookkeeping in one value ([`KvState`]): with per-request caches, the blocks of
//! the --kv-mem budget not reserved and the prefix pool of finished caches; with the paged KV
//! cache, its store (one pool of blocks for every running sequence) and its prefix cache of
//! shared blocks. What a finished or aborted sequence gives back, adapters' cached prefixes
//! dropped on unload, and the gauges all of it makes. Not here: admission, eviction and
//! preemption policy (`scheduler`, `prefix`, `paged_blocks`, `preempt`).

use std::sync::atomic::Ordering;

use hf2q_models::{Model, PagedKvCache};
use hf2q_tensor::paged_prefix::PrefixBlocks;

use super::paged_blocks;
use super::prefix::PrefixPool;
use super::seq::Seq;
use super::{Shared, BLOCK_TOKENS};

/// Where running sequences' keys and values live, and what the prefix caches keep.
pub(super) struct KvState {
    /// Per-request caches: blocks neither reserved by a running sequence nor held by `pool`.
    /// (The paged KV cache counts its blocks in its own pool.)
    pub free_blocks: usize,
    /// Per-request caches: finished sequences' caches kept for their prefixes.
    pub pool: PrefixPool,
    /// With `paged_kv`: one paged store per layer holding every running sequence's keys and
    /// values (its pool is the --kv-mem budget in blocks); a sequence takes its blocks as it
    /// grows and is preempted when a step cannot get them (`preempt`).
    pub paged: Option<PagedKvCache>,
    /// The paged KV cache's prefix cache: full blocks kept and shared by their tokens.
    pub blocks_cache: Option<PrefixBlocks>,
}

impl KvState {
    /// The state of a fresh engine: the whole budget free; the paged store when `paged_kv` asks
    /// for it and the model can make one (else a warning, and per-request caches). Sets
    /// `Shared::paged` to what was made.
    pub fn new(model: &Model, sh: &Shared) -> KvState {
        let cfg = &sh.cfg;
        let paged = if cfg.paged_kv {
            match model.paged_cache(sh.total_blocks.max(1), BLOCK_TOKENS, cfg.ctx_size) {
                Ok(c) => Some(c),
                Err(e) => {
                    eprintln!("warning: no paged KV cache ({e}); each request keeps its own cache");
                    None
                }
            }
        } else {
            None
        };
        sh.paged.store(paged.is_some(), Ordering::SeqCst);
        let blocks_cache = match &paged {
            Some(pc) if cfg.prefix_cache => Some(PrefixBlocks::new(pc.pool().block_tokens())),
            _ => None,
        };
        KvState {
            free_blocks: sh.total_blocks,
            pool: PrefixPool::default(),
            paged,
            blocks_cache,
        }
    }

    /// Takes back what a sequence that leaves holds: its table's blocks (the cached ones stay
    /// with the prefix cache), or its reservation of the budget.
    pub fn release(&mut self, s: &mut Seq<'_>) {
        match self.paged.as_mut() {
            Some(pc) => {
                paged_blocks::release(&mut s.table, pc.pool_mut(), self.blocks_cache.as_mut())
            }
            None => self.free_blocks += s.p.blocks,
        }
    }

    /// Drops what the prefix caches keep for an unloaded adapter.
    pub fn drop_adapter(&mut self, uid: u64) {
        self.free_blocks += self.pool.drop_adapter(uid);
        if let (Some(pc), Some(c)) = (self.paged.as_mut(), self.blocks_cache.as_mut()) {
            c.drop_adapter(pc.pool_mut(), uid);
        }
    }

    /// Updates the engine's gauges in `sh`. KV blocks in use: with the paged KV cache those its
    /// pool has handed out (to running sequences' tables); else the blocks reserved by running
    /// sequences and held by the prefix cache (`total - free_blocks`).
    pub fn publish(&self, running: &[Seq<'_>], sh: &Shared) {
        let blocks_used = match &self.paged {
            Some(pc) => paged_blocks::held(pc.pool(), self.blocks_cache.as_ref()),
            None => sh.total_blocks - self.free_blocks - self.pool.blocks(),
        };
        sh.running.store(running.len(), Ordering::SeqCst);
        sh.kv_reserved_blocks.store(blocks_used, Ordering::Relaxed);
        let paged_bytes =
            |s: &Seq<'_>| s.table.blocks().len() * BLOCK_TOKENS * sh.bytes_per_token as usize;
        let used: usize = running
            .iter()
            .map(|s| s.cache.bytes() + paged_bytes(s))
            .sum();
        sh.kv_used_bytes.store(used as u64, Ordering::Relaxed);
        // With the paged KV cache, its prefix cache's blocks (entries are blocks).
        let (cached_bytes, cached_entries) = match &self.blocks_cache {
            Some(c) => (
                c.len() * BLOCK_TOKENS * sh.bytes_per_token as usize,
                c.len(),
            ),
            None => (self.pool.bytes(), self.pool.len()),
        };
        sh.prefix_cache_bytes
            .store(cached_bytes as u64, Ordering::Relaxed);
        sh.prefix_cache_entries
            .store(cached_entries, Ordering::Relaxed);
    }
}
