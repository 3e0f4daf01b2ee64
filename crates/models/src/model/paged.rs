//! Batched steps over a paged KV cache: every running sequence's keys and values in blocks of
//! one pool per layer ([`PagedKvCache`]), each sequence naming its blocks with a
//! [`BlockTable`], and one forward over all the step's rows whose norms, RoPE, cache writes and
//! attention run once over the whole batch (not once per sequence as [`Model::step_batch`]
//! does).
//!
//! A step takes the blocks its rows need from the pool ([`BlockTable::reserve`]); when the
//! pool cannot give them the step fails with [`Error::KvBlocks`] before running anything, and
//! the caller (the scheduler) frees blocks, e.g. by preempting a sequence, and retries. Not
//! here: who runs in a step, admission, preemption (the server's scheduler); the kernels
//! (`hf2q_cpu::paged`, `hf2q_cuda::paged`).

use hf2q_tensor::paged::{BlockPool, BlockTable, PagedLayout, PagedStep, PagedStore};
use hf2q_tensor::Tensor;

use super::{batch_lora, Model, StepKv};
use crate::adapter_set::AdapterSet;
use crate::layers::served::{BatchLora, Fwd};
use crate::{Error, Result};

/// One paged store per layer (on the model's backend) and the pool of their blocks.
pub struct PagedKvCache {
    pub(super) layers: Vec<PagedStore>,
    pub(super) pool: BlockPool,
    /// Entries of each sequence's table: `max_context / B`, rounded up.
    pub(super) max_blocks: usize,
    /// Decode steps captured as CUDA graphs (`paged-graphs`), made at the first such step.
    pub(super) graphs: Option<super::paged_graph::PagedGraphs>,
}

impl PagedKvCache {
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    /// The pool, to release a finished or preempted sequence's table into.
    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }
    /// Most positions one sequence may hold.
    pub fn max_context(&self) -> usize {
        self.max_blocks * self.pool.block_tokens()
    }
    /// Bytes of keys and values held by all layers.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(PagedStore::bytes).sum()
    }
}

/// How a paged step chooses one item's token ([`Model::step_paged_pick`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowPick {
    /// No token this step: nothing comes back.
    Skip,
    /// The most likely token (the host sampler's greedy rule: first index on ties, NaN ignored).
    Greedy,
    /// One draw with these settings, on the device where there is one
    /// ([`crate::sampler::Sampler::device_args`] gives them).
    Sample(hf2q_cuda::SampleArgs),
    /// The logits of the item's last row, on the host.
    Logits,
}

impl RowPick {
    /// The device's form of this pick (`None`: a skipped row, nothing to pick).
    pub(super) fn on_device(&self) -> Option<hf2q_cuda::RowPick> {
        match self {
            RowPick::Skip => None,
            RowPick::Greedy => Some(hf2q_cuda::RowPick::Argmax),
            RowPick::Sample(a) => Some(hf2q_cuda::RowPick::Sample(*a)),
            RowPick::Logits => Some(hf2q_cuda::RowPick::Logits),
        }
    }
}

/// One item's result of [`Model::step_paged_pick`].
#[derive(Clone, Debug, PartialEq)]
pub enum Picked {
    /// A [`RowPick::Skip`] item.
    Nothing,
    /// The chosen token (a greedy row, or a row drawn on the device).
    Token(u32),
    /// The last row's logits `(V)`.
    Logits(Vec<f32>),
}

/// One sequence in a paged step: `tokens` fed at positions `pos0..` (its table holds at least
/// the blocks of `0..pos0` already written).
pub struct PagedItem<'a> {
    pub table: &'a mut BlockTable,
    pub pos0: usize,
    pub tokens: &'a [u32],
}

impl Model {
    /// A paged cache of `n_blocks` blocks of `block_tokens` positions in every layer, for
    /// sequences of at most `max_context` positions (0: the model's context length), keys and
    /// values stored as the model's KV type (f16 or f32).
    pub fn paged_cache(
        &self,
        n_blocks: usize,
        block_tokens: usize,
        max_context: usize,
    ) -> Result<PagedKvCache> {
        let max_context = if max_context == 0 {
            self.config.context_length
        } else {
            max_context
        };
        if self.blocks.iter().any(|b| b.kv_source().is_some()) {
            return Err(Error::Msg(
                "this model has layers attending over another layer's keys (Gemma 4's \
                 KV-shared layers), which have no paged KV cache path yet"
                    .into(),
            ));
        }
        let pool = BlockPool::new(n_blocks, block_tokens)?;
        let be = self.be();
        let layers = self
            .config
            .layer_heads
            .iter()
            .map(|&(n_kv_heads, head_dim)| {
                let layout = PagedLayout {
                    n_blocks,
                    n_kv_heads,
                    block_tokens,
                    head_dim,
                };
                if self.kv_layers.is_some() {
                    return Err(hf2q_tensor::Error::Msg(
                        "the paged KV cache stores one type in every layer, not a per-layer \
                         affine cache (kv_config.json)"
                            .into(),
                    ));
                }
                let ty = self.kv_type.same().ok_or_else(|| {
                    hf2q_tensor::Error::Msg(format!(
                        "the paged KV cache stores keys and values in one type, not {}",
                        self.kv_type.name()
                    ))
                })?;
                be.paged_alloc(layout, ty)
            })
            .collect::<hf2q_tensor::Result<Vec<_>>>()?;
        Ok(PagedKvCache {
            layers,
            pool,
            max_blocks: max_context.div_ceil(block_tokens),
            graphs: None,
        })
    }

    /// One batched step over a paged cache: for each item, feeds its tokens at `pos0..` and
    /// returns the logits `(V)` of its last token. Blocks the items lack are taken from the
    /// pool first (all the step's or, on [`Error::KvBlocks`], only those of the items before
    /// the one that did not fit; nothing runs). The caller advances positions.
    pub fn step_paged(
        &self,
        cache: &mut PagedKvCache,
        items: &mut [PagedItem<'_>],
    ) -> Result<Vec<Vec<f32>>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let h = self.paged_hidden(cache, items, None)?;
        self.last_logits(&h, &lens(items))
    }

    /// [`Model::step_paged`] taking the most likely token of each item's last row (the host
    /// sampler's rule: first index on ties, NaN ignored). On a GPU the pick runs on the device
    /// for every row in one launch and only the token ids come back.
    pub fn step_paged_argmax(
        &self,
        cache: &mut PagedKvCache,
        items: &mut [PagedItem<'_>],
    ) -> Result<Vec<u32>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let h = self.paged_hidden(cache, items, None)?;
        let logits = self.logits(&self.last_rows(&h, &lens(items))?)?;
        match &self.cuda {
            Some(cuda) => Ok(cuda.argmax_rows(&logits)?),
            None => {
                let v = logits.dims2().1;
                Ok(logits
                    .data()
                    .chunks(v)
                    .map(crate::sampler::argmax)
                    .collect())
            }
        }
    }

    /// [`Model::step_paged`] choosing each item's token as `picks[i]` says (one per item): on a
    /// GPU greedy and sampled rows are picked on the device and only their ids come back, only
    /// the [`RowPick::Logits`] rows bring their logits to the host, and [`RowPick::Skip`] rows
    /// (a prompt chunk that does not end its prompt) bring nothing and skip the output layer. On
    /// the CPU greedy rows are picked from the logits with the host sampler's rule and sampled
    /// rows come back as logits (the caller's sampler then draws with the same number).
    pub fn step_paged_pick(
        &self,
        cache: &mut PagedKvCache,
        items: &mut [PagedItem<'_>],
        picks: &[RowPick],
    ) -> Result<Vec<Picked>> {
        self.step_paged_served(cache, items, picks, None)
    }

    /// [`Model::step_paged_pick`] with served LoRA adapters: `served` is the adapters and each
    /// item's slot (`None`: the base), the base products running once over every row and each
    /// adapter's term over its items' rows (as [`Model::step_batch_served`]). A step with
    /// adapter rows runs eagerly (never as a captured graph).
    pub fn step_paged_served(
        &self,
        cache: &mut PagedKvCache,
        items: &mut [PagedItem<'_>],
        picks: &[RowPick],
        served: Option<(&AdapterSet, &[Option<usize>])>,
    ) -> Result<Vec<Picked>> {
        if picks.len() != items.len() {
            return Err(Error::Msg(format!(
                "{} picks for {} items of a paged step",
                picks.len(),
                items.len()
            )));
        }
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let lora = batch_lora(served, &lens(items))?;
        if lora.is_none() {
            if let Some(out) = self.paged_graph_pick(cache, items, picks)? {
                return Ok(out);
            }
        }
        let h = self.paged_hidden(cache, items, lora.as_ref())?;
        // The last row of each item that picks.
        let mut end = 0;
        let mut rows = Vec::new();
        for (it, p) in items.iter().zip(picks) {
            end += it.tokens.len();
            if *p != RowPick::Skip {
                rows.push(end - 1);
            }
        }
        if rows.is_empty() {
            return Ok(picks.iter().map(|_| Picked::Nothing).collect());
        }
        let logits = self.logits(&self.rows_at(&h, &rows)?)?;
        let got = match &self.cuda {
            Some(cuda) => {
                let dev: Vec<hf2q_cuda::RowPick> =
                    picks.iter().filter_map(RowPick::on_device).collect();
                cuda.pick_rows(&logits, &dev)?
            }
            None => {
                let l = self.be().to_host(&logits)?;
                let v = l.dims2().1;
                picks
                    .iter()
                    .filter(|p| **p != RowPick::Skip)
                    .zip(l.data().chunks(v))
                    .map(|(p, row)| match p {
                        RowPick::Greedy => hf2q_cuda::RowPicked::Token(crate::sampler::argmax(row)),
                        _ => hf2q_cuda::RowPicked::Logits(row.to_vec()),
                    })
                    .collect()
            }
        };
        Ok(spread_picks(picks, got))
    }

    /// Rows `rows` of `h (N, D)`, in that order -> `(rows.len(), D)`.
    fn rows_at(&self, h: &Tensor, rows: &[usize]) -> Result<Tensor> {
        let be = self.be();
        if let [r] = rows {
            return Ok(be.rows(h, *r, 1)?);
        }
        let parts = rows
            .iter()
            .map(|&r| be.rows(h, r, 1))
            .collect::<hf2q_tensor::Result<Vec<_>>>()?;
        Ok(be.concat_rows(&parts)?)
    }

    /// The blocks' output for every row of the step, final-normed `(ΣT, D)`.
    fn paged_hidden(
        &self,
        cache: &mut PagedKvCache,
        items: &mut [PagedItem<'_>],
        lora: Option<&BatchLora<'_>>,
    ) -> Result<Tensor> {
        self.reserve_items(cache, items)?;
        let mut step = self.paged_rows(cache, items)?;
        self.be().paged_prepare(&mut step)?;
        let ids: Vec<u32> = items
            .iter()
            .flat_map(|it| it.tokens.iter().copied())
            .collect();
        self.paged_forward(&mut cache.layers, &step, &ids, lora)
    }

    /// Takes from the pool the blocks each item's tokens need (see [`Model::step_paged`]).
    pub(super) fn reserve_items(
        &self,
        cache: &mut PagedKvCache,
        items: &mut [PagedItem<'_>],
    ) -> Result<()> {
        let max_ctx = cache.max_context();
        for it in items.iter_mut() {
            if it.tokens.is_empty() {
                return Err(Error::Msg("no tokens to run".into()));
            }
            let end = it.pos0 + it.tokens.len();
            if end > max_ctx {
                return Err(Error::Msg(format!(
                    "context full: {} + {} tokens exceed the context size {max_ctx}",
                    it.pos0,
                    it.tokens.len()
                )));
            }
            it.table.reserve(&mut cache.pool, end)?;
        }
        Ok(())
    }

    /// The forward of `ids`, one per row of `step` (prepared on the backend), over the paged
    /// `layers`, with the served adapters' terms of `lora`: final-normed `(ΣT, D)`.
    pub(super) fn paged_forward(
        &self,
        layers: &mut [PagedStore],
        step: &PagedStep,
        ids: &[u32],
        lora: Option<&BatchLora<'_>>,
    ) -> Result<Tensor> {
        let be = self.be();
        let cx = Fwd { be, lora };
        let mut x: Tensor = be.embedding(&self.embed, ids, self.config.embed_scale)?;
        let mut kv = StepKv::Paged { layers, step, ids };
        self.run_blocks_kv(&cx, 0..self.blocks.len(), &mut x, &mut kv)?;
        Ok(be.rms_norm(
            &x,
            &self.final_norm,
            self.config.rms_eps,
            self.config.norm_offset,
        )?)
    }

    /// The step's rows: item `i`'s tokens are rows of sequence `i` at `pos0..`, each stored at
    /// the slot its table gives that position.
    pub(super) fn paged_rows(
        &self,
        cache: &PagedKvCache,
        items: &[PagedItem<'_>],
    ) -> Result<PagedStep> {
        let layout = PagedLayout {
            n_blocks: cache.pool.n_blocks(),
            n_kv_heads: 1,
            block_tokens: cache.pool.block_tokens(),
            head_dim: 1,
        };
        let mb = cache.max_blocks;
        let mut step = PagedStep {
            tables: vec![-1; items.len() * mb],
            max_blocks: mb,
            ..PagedStep::default()
        };
        for (i, it) in items.iter().enumerate() {
            it.table.write_row(&mut step.tables[i * mb..][..mb])?;
            for p in it.pos0..it.pos0 + it.tokens.len() {
                let slot = layout
                    .slot(it.table.blocks(), p)
                    .ok_or_else(|| Error::Msg(format!("position {p} is past its table")))?;
                step.seq.push(i as i32);
                step.pos.push(to_i32(p)?);
                step.slots.push(to_i32(slot)?);
            }
        }
        Ok(step)
    }
}

/// Each item's result from the picks of its non-[`RowPick::Skip`] rows, in order.
pub(super) fn spread_picks(picks: &[RowPick], got: Vec<hf2q_cuda::RowPicked>) -> Vec<Picked> {
    let mut got = got.into_iter();
    picks
        .iter()
        .map(|p| match p {
            RowPick::Skip => Picked::Nothing,
            _ => match got.next() {
                Some(hf2q_cuda::RowPicked::Token(t)) => Picked::Token(t),
                Some(hf2q_cuda::RowPicked::Logits(l)) => Picked::Logits(l),
                None => Picked::Nothing,
            },
        })
        .collect()
}

fn lens(items: &[PagedItem<'_>]) -> Vec<usize> {
    items.iter().map(|it| it.tokens.len()).collect()
}

fn to_i32(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Msg(format!("{v} does not fit the paged cache's 32 bits")))
}
