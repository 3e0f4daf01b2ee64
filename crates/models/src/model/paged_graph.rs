//! Paged decode steps replayed as CUDA graphs (`--cuda-opt paged-graphs=N`: steps of up to N
//! rows, default 64; [`Model::set_paged_graphs`]): a step whose items are all one-token decode rows is padded up to a batch-size bucket ([`BUCKETS`]) and
//! run as that bucket's graph, captured once per [`PagedKvCache`]. Each graph reads its rows
//! (sequence, position, slot of every row, the block tables) from arrays at fixed device
//! addresses ([`hf2q_cuda::PagedInputs`]) that the host writes before the launch, its token
//! ids from its own buffer, and splits the attention's keys for the cache's longest context,
//! so one graph serves every step of its size whatever the sequences' lengths. Padding rows
//! (position -1) store nothing and attend to nothing; their logits are never read.
//!
//! The first step of a bucket runs eagerly over the same fixed arrays (the weights and the
//! rows' kernels come onto the device then; capturing runs nothing), then the bucket is
//! captured for the next steps. A model whose step has an op that only runs eagerly (or that
//! already refused a one-sequence capture) runs its paged steps eagerly from then on. Steps with
//! prompt chunks (items of several tokens), more rows than `paged-graphs` allows (64 by
//! default: 96 and 128 rows are not measured as graphs yet), or on the CPU take the eager path
//! of [`Model::step_paged_pick`].
//!
//! Not here: the forward itself and the eager picks (`paged.rs`), capture and replay
//! (`hf2q_cuda::CudaBackend::capture`).

use std::collections::HashMap;

use hf2q_cuda::backend::{StepGraph, StepOutput};
use hf2q_cuda::PagedInputs;
use hf2q_tensor::paged::PagedStep;

use super::paged::{spread_picks, PagedItem, PagedKvCache, Picked, RowPick};
use super::Model;
use crate::{Error, Result};

/// Batch sizes a graph is captured for; a step is padded up to the first that holds it.
pub(crate) const BUCKETS: [usize; 11] = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128];

/// One paged cache's captured decode steps and the fixed row arrays they read.
pub(crate) struct PagedGraphs {
    inputs: PagedInputs,
    /// By bucket size.
    graphs: HashMap<usize, StepGraph>,
    /// This model's step could not be captured: its steps run eagerly.
    refused: bool,
}

/// The bucket a step of `rows` rows is padded to (`None`: more than the largest).
pub(crate) fn bucket_for(rows: usize) -> Option<usize> {
    BUCKETS.iter().copied().find(|&b| b >= rows)
}

/// `step`'s rows padded to `bucket` rows and tables: padding rows (sequence 0, position and
/// slot -1) store nothing and attend to nothing.
pub(crate) fn pad_step(step: &mut PagedStep, bucket: usize) {
    let extra = bucket.saturating_sub(step.len());
    step.seq.extend(std::iter::repeat_n(0, extra));
    step.pos.extend(std::iter::repeat_n(-1, extra));
    step.slots.extend(std::iter::repeat_n(-1, extra));
    let tables = bucket * step.max_blocks;
    if step.tables.len() < tables {
        step.tables.resize(tables, -1);
    }
}

/// A host-only copy of `step`'s rows (a capture builds its step afresh on every attempt).
fn host_copy(step: &PagedStep) -> PagedStep {
    PagedStep {
        seq: step.seq.clone(),
        pos: step.pos.clone(),
        slots: step.slots.clone(),
        tables: step.tables.clone(),
        max_blocks: step.max_blocks,
        device: None,
    }
}

impl Model {
    /// [`Model::step_paged_pick`] as a replayed graph, where it applies (see the module
    /// header): `None` sends the step down the eager path.
    pub(super) fn paged_graph_pick(
        &self,
        cache: &mut PagedKvCache,
        items: &mut [PagedItem<'_>],
        picks: &[RowPick],
    ) -> Result<Option<Vec<Picked>>> {
        let Some(cuda) = self
            .cuda
            .as_ref()
            .filter(|_| self.cuda_graphs && items.len() <= self.paged_graph_rows)
        else {
            return Ok(None);
        };
        let Some(bucket) = bucket_for(items.len()) else {
            return Ok(None);
        };
        if items.iter().any(|it| it.tokens.len() != 1)
            || picks.iter().all(|p| *p == RowPick::Skip)
            || self
                .graphs_refused
                .load(std::sync::atomic::Ordering::Relaxed)
            || cache.graphs.as_ref().is_some_and(|g| g.refused)
        {
            return Ok(None);
        }
        // A replay reads the ids on the device, past every host check: check them here.
        if let Some(bad) = items
            .iter()
            .map(|it| it.tokens[0])
            .find(|&t| t as usize >= self.embed.rows)
        {
            return Err(Error::Msg(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                self.embed.rows
            )));
        }
        self.reserve_items(cache, items)?;
        let mut step = self.paged_rows(cache, items)?;
        pad_step(&mut step, bucket);
        let mut ids: Vec<u32> = items.iter().map(|it| it.tokens[0]).collect();
        ids.resize(bucket, 0);
        let at: Vec<(usize, hf2q_cuda::RowPick)> = picks
            .iter()
            .enumerate()
            .filter_map(|(row, p)| Some((row, p.on_device()?)))
            .collect();
        let max_len = cache.max_context();
        if cache.graphs.is_none() {
            cache.graphs = Some(PagedGraphs {
                inputs: cuda.paged_inputs(BUCKETS[BUCKETS.len() - 1], cache.max_blocks)?,
                graphs: HashMap::new(),
                refused: false,
            });
        }
        let PagedKvCache { layers, graphs, .. } = cache;
        let gs = graphs.as_mut().expect("made above");
        if let Some(g) = gs.graphs.get_mut(&bucket) {
            cuda.paged_prepare_fixed(&mut step, &mut gs.inputs, max_len)?;
            drop(step);
            cuda.replay_launch(g, &ids, 0)?;
            return Ok(Some(spread_picks(picks, cuda.pick_graph_rows(g, &at)?)));
        }
        // The bucket's first step: eagerly, over the arrays its graph will read.
        let template = host_copy(&step);
        cuda.paged_prepare_fixed(&mut step, &mut gs.inputs, max_len)?;
        let got = {
            let logits = self.logits(&self.paged_forward(layers, &step, &ids, None)?)?;
            cuda.pick_rows_at(&logits, &at)?
        };
        drop(step);
        let vocab = self.lm_head.rows;
        let captured = cuda.capture(&ids, 0, bucket * vocab, StepOutput::Logits, || {
            let mut step = host_copy(&template);
            cuda.paged_prepare_fixed(&mut step, &mut gs.inputs, max_len)?;
            let h = self.paged_forward(layers, &step, &ids, None)?;
            self.logits(&h)
        });
        // This step's tokens are picked already: a capture that fails (an op that only runs
        // eagerly, or one that reads back to the host) leaves this cache's steps eager.
        match captured {
            Ok(g) => {
                gs.graphs.insert(bucket, g);
            }
            Err(_) => gs.refused = true,
        }
        Ok(Some(spread_picks(picks, got)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_pad_to_the_first_bucket_that_holds_them() {
        assert_eq!(bucket_for(1), Some(1));
        assert_eq!(bucket_for(3), Some(4));
        assert_eq!(bucket_for(17), Some(24));
        assert_eq!(bucket_for(128), Some(128));
        assert_eq!(bucket_for(129), None);
        let mut step = PagedStep {
            seq: vec![0, 1, 2],
            pos: vec![5, 0, 9],
            slots: vec![21, 32, 73],
            tables: vec![1, -1, 2, -1, 4, 5],
            max_blocks: 2,
            device: None,
        };
        pad_step(&mut step, 4);
        assert_eq!(step.seq, [0, 1, 2, 0]);
        assert_eq!(step.pos, [5, 0, 9, -1]);
        assert_eq!(step.slots, [21, 32, 73, -1]);
        assert_eq!(step.tables, [1, -1, 2, -1, 4, 5, -1, -1]);
    }
}
