//! The paged KV cache's bookkeeping, shared by every backend: a pool of fixed-size blocks of
//! `B` positions, one block table per sequence (its positions' blocks in order), reference
//! counts so that a block can be shared (a common prefix), and the layout of a layer's blocks in
//! memory.
//!
//! A layer's blocks live in a [`PagedStore`]: on the host ([`HostPagedLayer`], written here; the
//! attention over it is `hf2q_cpu::paged`) or in a device backend's memory (`hf2q_cuda::paged`),
//! both in [`PagedLayout`]'s order. One batched step's rows ([`PagedStep`]: each row's sequence,
//! position and slot, the sequences' tables) are what the backends' paged ops read. What to
//! admit and whom to preempt is the scheduler's: it asks the pool ([`BlockPool::free_blocks`])
//! and the tables ([`BlockTable::reserve`], all or nothing) and frees what it preempts.

use std::fmt;

use crate::kv::{DeviceKv, KvType};
use crate::op::KvScalar;

/// A block's index in its pool (the same index in every layer's storage).
pub type BlockId = u32;

/// Where a layer's keys (and, alike, values) live: `(n_blocks, Hkv, B, Dh)` elements, so one
/// head's positions within a block are consecutive rows of `Dh` (the one-token decode reads a
/// whole row per key, as it does from a contiguous cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedLayout {
    pub n_blocks: usize,
    pub n_kv_heads: usize,
    /// B: positions per block.
    pub block_tokens: usize,
    pub head_dim: usize,
}

impl PagedLayout {
    /// Elements of one layer's keys (as many again for its values).
    pub fn elements(&self) -> usize {
        self.n_blocks * self.n_kv_heads * self.block_tokens * self.head_dim
    }
    /// Index of the first element of the row of `(block, kv head, offset in block)`.
    #[inline]
    pub fn row(&self, block: usize, head: usize, offset: usize) -> usize {
        ((block * self.n_kv_heads + head) * self.block_tokens + offset) * self.head_dim
    }
    /// The slot of position `pos` of a sequence whose table is `table`: `block * B + pos % B`
    /// (the value a cache write takes), or `None` past the table's blocks.
    pub fn slot(&self, table: &[BlockId], pos: usize) -> Option<usize> {
        let b = *table.get(pos / self.block_tokens)? as usize;
        Some(b * self.block_tokens + pos % self.block_tokens)
    }
}

/// The rows of one batched attention call over a paged cache, as flat arrays (the form a device
/// kernel reads them in): row `r` is the query of sequence `seq[r]` at position `pos[r]` (it sees
/// that sequence's keys `0..=pos[r]`, within the window); a row with `pos[r] < 0` is padding and
/// yields zeros. Sequence `s`'s block table is `tables[s * max_blocks ..][.. max_blocks]`
/// (unused entries may hold anything: only blocks below a row's position are read).
#[derive(Clone, Copy, Debug)]
pub struct PagedRows<'a> {
    pub seq: &'a [i32],
    pub pos: &'a [i32],
    pub tables: &'a [i32],
    pub max_blocks: usize,
}

impl PagedRows<'_> {
    /// Checks every row against the tables and the pool: a sequence index outside the tables, a
    /// position past its table's `max_blocks * B` positions, or a block id outside the pool is an
    /// error naming the row (the device kernel cannot check; the host does before launching).
    pub fn check(&self, layout: &PagedLayout) -> crate::Result<()> {
        let shape = |m: String| Err(crate::Error::Shape(format!("paged attention: {m}")));
        if self.seq.len() != self.pos.len() {
            return shape(format!(
                "{} row sequences for {} row positions",
                self.seq.len(),
                self.pos.len()
            ));
        }
        if self.max_blocks == 0 || !self.tables.len().is_multiple_of(self.max_blocks) {
            return shape(format!(
                "{} table entries are not whole tables of {} blocks",
                self.tables.len(),
                self.max_blocks
            ));
        }
        let n_seqs = self.tables.len() / self.max_blocks;
        for (r, (&s, &p)) in self.seq.iter().zip(self.pos).enumerate() {
            if p < 0 {
                continue;
            }
            let (s, p) = (s as usize, p as usize);
            if s >= n_seqs {
                return shape(format!("row {r} names sequence {s} of {n_seqs}"));
            }
            let used = p / layout.block_tokens + 1;
            if used > self.max_blocks {
                return shape(format!(
                    "row {r} at position {p} needs {used} blocks of {}, tables hold {}",
                    layout.block_tokens, self.max_blocks
                ));
            }
            let table = &self.tables[s * self.max_blocks..][..used];
            if let Some(b) = table
                .iter()
                .find(|&&b| b < 0 || b as usize >= layout.n_blocks)
            {
                return shape(format!(
                    "row {r}: block {b} of sequence {s} is outside the pool of {}",
                    layout.n_blocks
                ));
            }
        }
        Ok(())
    }
}

/// Rows `row..row + n` of one batched call: one sequence at positions `pos0..pos0 + n` (a
/// prefill chunk, or one decode row when `n` is 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRun {
    pub row: usize,
    pub n: usize,
    pub seq: usize,
    pub pos0: usize,
}

impl PagedRows<'_> {
    /// The rows as maximal runs of one sequence at consecutive positions, in row order; padding
    /// rows (`pos < 0`) belong to none.
    pub fn runs(&self) -> Vec<RowRun> {
        let mut runs: Vec<RowRun> = Vec::new();
        for (r, (&s, &pos)) in self.seq.iter().zip(self.pos).enumerate() {
            let Ok(pos) = usize::try_from(pos) else {
                continue;
            };
            match runs.last_mut() {
                Some(run)
                    if run.row + run.n == r && run.seq == s as usize && run.pos0 + run.n == pos =>
                {
                    run.n += 1
                }
                _ => runs.push(RowRun {
                    row: r,
                    n: 1,
                    seq: s as usize,
                    pos0: pos,
                }),
            }
        }
        runs
    }
}

/// A KV element a host paged layer stores, from f32 (rounded to nearest, ties to even).
pub trait PagedElem: KvScalar + Default {
    fn from_f32(v: f32) -> Self;
}

impl PagedElem for f32 {
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl PagedElem for half::f16 {
    fn from_f32(v: f32) -> half::f16 {
        half::f16::from_f32(v)
    }
}

/// One layer's keys and values in blocks, on the host.
pub struct HostPagedLayer<T> {
    pub layout: PagedLayout,
    /// `(n_blocks, Hkv, B, Dh)`
    pub k: Vec<T>,
    /// `(n_blocks, Hkv, B, Dh)`
    pub v: Vec<T>,
}

impl<T: PagedElem> HostPagedLayer<T> {
    /// A zeroed layer.
    pub fn new(layout: PagedLayout) -> HostPagedLayer<T> {
        let n = layout.elements();
        HostPagedLayer {
            layout,
            k: vec![T::default(); n],
            v: vec![T::default(); n],
        }
    }

    /// Writes row `r` of `k, v (R, Hkv*Dh)` at slot `slots[r]` (`block * B + offset`, from
    /// [`PagedLayout::slot`]); a negative slot is a padding row and is skipped.
    pub fn write(&mut self, k: &[f32], v: &[f32], slots: &[i32]) -> crate::Result<()> {
        let l = self.layout;
        let width = l.n_kv_heads * l.head_dim;
        if k.len() != slots.len() * width || v.len() != k.len() {
            return Err(crate::Error::Shape(format!(
                "paged write: {} slots of width {width}, keys {} and values {}",
                slots.len(),
                k.len(),
                v.len()
            )));
        }
        for (r, &slot) in slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let slot = slot as usize;
            let (block, off) = (slot / l.block_tokens, slot % l.block_tokens);
            if block >= l.n_blocks {
                return Err(crate::Error::Shape(format!(
                    "paged write: row {r}'s slot {slot} is past the pool's {} blocks",
                    l.n_blocks
                )));
            }
            for h in 0..l.n_kv_heads {
                let dst = l.row(block, h, off);
                let src = r * width + h * l.head_dim;
                for d in 0..l.head_dim {
                    self.k[dst + d] = T::from_f32(k[src + d]);
                    self.v[dst + d] = T::from_f32(v[src + d]);
                }
            }
        }
        Ok(())
    }
}

/// A host paged layer of either element type.
pub enum HostPaged {
    F16(HostPagedLayer<half::f16>),
    F32(HostPagedLayer<f32>),
}

/// One layer's paged keys and values, where a backend keeps them.
pub enum PagedStore {
    Host(HostPaged),
    /// A device backend's layer (the backend that made it downcasts it back).
    Device(Box<dyn DeviceKv>),
}

impl PagedStore {
    /// A zeroed host layer of `ty` values (f16 or f32; the block types have no paged form yet).
    pub fn host(layout: PagedLayout, ty: KvType) -> crate::Result<PagedStore> {
        Ok(PagedStore::Host(match ty {
            KvType::F16 => HostPaged::F16(HostPagedLayer::new(layout)),
            KvType::F32 => HostPaged::F32(HostPagedLayer::new(layout)),
            other => {
                return Err(crate::Error::Msg(format!(
                    "the paged KV cache stores f16 or f32, not {}",
                    other.name()
                )))
            }
        }))
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            PagedStore::Host(HostPaged::F16(l)) => 4 * l.k.len(),
            PagedStore::Host(HostPaged::F32(l)) => 8 * l.k.len(),
            PagedStore::Device(d) => d.bytes(),
        }
    }
}

/// One batched step's rows over a paged cache: row `r` is the token of sequence `seq[r]` at
/// position `pos[r]`, stored at `slots[r]`; sequence `s`'s table is
/// `tables[s * max_blocks ..][.. max_blocks]` ([`PagedRows`]). `device` is a backend's own copy of
/// these arrays ([`crate::op::Backend::paged_prepare`]), made once per step and read by every
/// layer.
#[derive(Default)]
pub struct PagedStep {
    pub seq: Vec<i32>,
    pub pos: Vec<i32>,
    pub slots: Vec<i32>,
    pub tables: Vec<i32>,
    pub max_blocks: usize,
    pub device: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl PagedStep {
    pub fn rows(&self) -> PagedRows<'_> {
        PagedRows {
            seq: &self.seq,
            pos: &self.pos,
            tables: &self.tables,
            max_blocks: self.max_blocks,
        }
    }
    /// Rows in the step.
    pub fn len(&self) -> usize {
        self.pos.len()
    }
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }
}

/// The pool ran out: `needed` more blocks were asked for, `free` were left. Nothing was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfBlocks {
    pub needed: usize,
    pub free: usize,
}

impl fmt::Display for OutOfBlocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the KV cache needs {} more blocks and {} are free",
            self.needed, self.free
        )
    }
}

impl std::error::Error for OutOfBlocks {}

/// Free blocks and each block's reference count. Blocks are handed out lowest id first (a
/// small working set stays at the start of the pool) and come back when their last holder
/// releases them.
#[derive(Debug)]
pub struct BlockPool {
    block_tokens: usize,
    refs: Vec<u32>,
    /// Free ids, highest first (`pop` takes the lowest).
    free: Vec<BlockId>,
}

impl BlockPool {
    /// A pool of `n_blocks` free blocks of `block_tokens` positions each.
    pub fn new(n_blocks: usize, block_tokens: usize) -> crate::Result<BlockPool> {
        if block_tokens == 0 || n_blocks > BlockId::MAX as usize {
            return Err(crate::Error::Shape(format!(
                "a pool of {n_blocks} blocks of {block_tokens} positions"
            )));
        }
        Ok(BlockPool {
            block_tokens,
            refs: vec![0; n_blocks],
            free: (0..n_blocks as BlockId).rev().collect(),
        })
    }
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }
    pub fn n_blocks(&self) -> usize {
        self.refs.len()
    }
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
    pub fn used_blocks(&self) -> usize {
        self.n_blocks() - self.free_blocks()
    }
    /// Blocks that `tokens` positions take.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens)
    }
    /// Holders of `id` (0: free).
    pub fn refs(&self, id: BlockId) -> u32 {
        self.refs[id as usize]
    }

    /// `n` blocks, each held once, or none at all when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<BlockId>, OutOfBlocks> {
        if n > self.free.len() {
            return Err(OutOfBlocks {
                needed: n,
                free: self.free.len(),
            });
        }
        let got = self.free.split_off(self.free.len() - n);
        let got: Vec<BlockId> = got.into_iter().rev().collect();
        for &b in &got {
            self.refs[b as usize] = 1;
        }
        Ok(got)
    }

    /// One more holder of an allocated block (a second sequence sharing it).
    ///
    /// # Panics
    /// If the block is free: sharing a free block would hand it out twice (a scheduler bug).
    pub fn retain(&mut self, id: BlockId) {
        let r = &mut self.refs[id as usize];
        assert!(*r > 0, "retain of free block {id}");
        *r += 1;
    }

    /// One holder fewer; the block is free again when none is left.
    ///
    /// # Panics
    /// If the block is already free (a double release: a scheduler bug).
    pub fn release(&mut self, id: BlockId) {
        let r = &mut self.refs[id as usize];
        assert!(*r > 0, "release of free block {id}");
        *r -= 1;
        if *r == 0 {
            // Keep the free list highest first so that the lowest id goes out next.
            let at = self.free.partition_point(|&f| f > id);
            self.free.insert(at, id);
        }
    }
}

/// One sequence's blocks, in position order: position `p` lives in `blocks[p / B]` at offset
/// `p % B`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
}

impl BlockTable {
    pub fn new() -> BlockTable {
        BlockTable::default()
    }
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }
    /// Positions the table's blocks cover.
    pub fn capacity(&self, pool: &BlockPool) -> usize {
        self.blocks.len() * pool.block_tokens()
    }

    /// Makes the table cover positions `0..tokens`, taking the blocks it lacks from `pool`: all
    /// of them or none (the table is unchanged on error).
    pub fn reserve(&mut self, pool: &mut BlockPool, tokens: usize) -> Result<(), OutOfBlocks> {
        let need = pool.blocks_for(tokens).saturating_sub(self.blocks.len());
        if need > 0 {
            self.blocks.extend(pool.alloc(need)?);
        }
        Ok(())
    }

    /// Starts the table with `shared` (blocks another table holds: a cached prefix), each
    /// retained once more.
    ///
    /// # Panics
    /// If the table is not empty.
    pub fn share(&mut self, pool: &mut BlockPool, shared: &[BlockId]) {
        assert!(
            self.blocks.is_empty(),
            "sharing into a table that has blocks"
        );
        for &b in shared {
            pool.retain(b);
        }
        self.blocks.extend_from_slice(shared);
    }

    /// Puts `id` (a block another holder has: a cached one) at entry `k`, retained once more,
    /// in place of the block there (released; it must hold nothing the sequence wrote) or, with
    /// `k` the table's length, after the last.
    ///
    /// # Panics
    /// If `k` is past the table's length, or `id` is free.
    pub fn put_shared(&mut self, pool: &mut BlockPool, k: usize, id: BlockId) {
        assert!(
            k <= self.blocks.len(),
            "entry {k} of a table of {}",
            self.blocks.len()
        );
        pool.retain(id);
        if k == self.blocks.len() {
            self.blocks.push(id);
        } else {
            pool.release(std::mem::replace(&mut self.blocks[k], id));
        }
    }

    /// Keeps the blocks of positions `0..tokens` and releases the rest.
    pub fn truncate(&mut self, pool: &mut BlockPool, tokens: usize) {
        let keep = pool.blocks_for(tokens);
        for b in self.blocks.drain(keep.min(self.blocks.len())..) {
            pool.release(b);
        }
    }

    /// Releases every block (a finished or preempted sequence).
    pub fn clear(&mut self, pool: &mut BlockPool) {
        self.truncate(pool, 0)
    }

    /// The table as a row of `max_blocks` entries of a flat table array ([`PagedRows`]),
    /// unused entries `-1`. Errors when the table has more blocks than the row holds.
    pub fn write_row(&self, row: &mut [i32]) -> crate::Result<()> {
        if self.blocks.len() > row.len() {
            return Err(crate::Error::Shape(format!(
                "a table of {} blocks in a row of {}",
                self.blocks.len(),
                row.len()
            )));
        }
        row.fill(-1);
        for (o, &b) in row.iter_mut().zip(&self.blocks) {
            *o = b as i32;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_is_all_or_nothing_and_lowest_first() {
        let mut pool = BlockPool::new(4, 16).unwrap();
        assert_eq!(pool.alloc(2).unwrap(), vec![0, 1]);
        assert_eq!(pool.alloc(3), Err(OutOfBlocks { needed: 3, free: 2 }));
        assert_eq!(pool.free_blocks(), 2);
        pool.release(0);
        assert_eq!(pool.alloc(2).unwrap(), vec![0, 2]);
        assert_eq!(pool.free_blocks(), 1);
    }

    #[test]
    fn tables_grow_share_truncate_and_free() {
        let mut pool = BlockPool::new(8, 16).unwrap();
        let mut a = BlockTable::new();
        a.reserve(&mut pool, 1).unwrap();
        assert_eq!(a.blocks(), &[0]);
        a.reserve(&mut pool, 16).unwrap();
        assert_eq!(a.blocks().len(), 1, "16 positions fit one block");
        a.reserve(&mut pool, 33).unwrap();
        assert_eq!(a.blocks(), &[0, 1, 2]);
        // A second sequence shares the first two blocks (a 32-token prefix), then grows.
        let mut b = BlockTable::new();
        b.share(&mut pool, &a.blocks()[..2]);
        b.reserve(&mut pool, 40).unwrap();
        assert_eq!(b.blocks(), &[0, 1, 3]);
        assert_eq!((pool.refs(0), pool.refs(2), pool.refs(3)), (2, 1, 1));
        // Asking for more than is free changes nothing.
        let before = b.clone();
        let err = b.reserve(&mut pool, 16 * 9).unwrap_err();
        assert_eq!(err, OutOfBlocks { needed: 6, free: 4 });
        assert_eq!(b, before);
        a.clear(&mut pool);
        assert_eq!(
            (pool.refs(0), pool.refs(2)),
            (1, 0),
            "shared blocks stay held by b"
        );
        assert_eq!(pool.free_blocks(), 5);
        b.truncate(&mut pool, 17);
        assert_eq!(b.blocks(), &[0, 1]);
        b.clear(&mut pool);
        assert_eq!(pool.free_blocks(), 8);
        assert_eq!(pool.alloc(8).unwrap(), (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn slots_and_rows() {
        let layout = PagedLayout {
            n_blocks: 6,
            n_kv_heads: 2,
            block_tokens: 4,
            head_dim: 8,
        };
        let table = [5, 2, 0];
        assert_eq!(layout.slot(&table, 0), Some(20));
        assert_eq!(layout.slot(&table, 6), Some(10));
        assert_eq!(layout.slot(&table, 11), Some(3));
        assert_eq!(layout.slot(&table, 12), None);
        assert_eq!(layout.row(2, 1, 3), ((2 * 2 + 1) * 4 + 3) * 8);
        assert_eq!(layout.elements(), 6 * 2 * 4 * 8);

        let mut flat = vec![0i32; 8];
        let mut pool = BlockPool::new(6, 4).unwrap();
        let mut t = BlockTable::new();
        t.reserve(&mut pool, 9).unwrap();
        t.write_row(&mut flat[4..]).unwrap();
        assert_eq!(flat, [0, 0, 0, 0, 0, 1, 2, -1]);
        assert!(t.write_row(&mut flat[..2]).is_err());

        let rows = PagedRows {
            seq: &[1, 0, 0],
            pos: &[8, -1, 3],
            tables: &flat,
            max_blocks: 4,
        };
        rows.check(&layout).unwrap();
        let bad_pos = PagedRows {
            pos: &[16, -1, 3],
            ..rows
        };
        assert!(bad_pos
            .check(&layout)
            .unwrap_err()
            .to_string()
            .contains("row 0"));
        let bad_seq = PagedRows {
            seq: &[2, 0, 0],
            ..rows
        };
        assert!(bad_seq.check(&layout).is_err());
        // Sequence 1's fourth entry is -1: a row that would read it is refused.
        let unset = PagedRows {
            pos: &[12, -1, 3],
            ..rows
        };
        assert!(unset
            .check(&layout)
            .unwrap_err()
            .to_string()
            .contains("outside"));
    }
}
