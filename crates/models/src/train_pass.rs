//! One training pass over a packed batch: the forward through every block (keeping each
//! block's input, and for blocks not recomputed everything its backward needs), the fused output
//! layer and log-softmax at the targets, then the backward block by block in reverse, each
//! block recomputing its forward from its input first where it is checkpointed. The adapters'
//! gradients accumulate into a [`LoraGrads`]; nothing else of the model has one.
//!
//! The loss is the caller's: a pass takes per-row weights `g` and back-propagates
//! `Σ_n g_n · log p(target_n)`. SFT's mean cross-entropy over T labelled tokens is
//! `g_n = −1/T` on labelled rows, known before the pass ([`Model::train_pass`]). DPO's
//! weights depend on the pass's own log-probabilities (`∂loss/∂log p` of each sequence's sum):
//! [`Model::train_pass_with`] runs the blocks forward once, the output layer once forward only,
//! asks the caller for the weights, then runs the output layer again with them and the
//! backward (one more output-layer forward, no second pass through the blocks). The reference
//! policy of DPO is the same base with other adapters (or none) swapped in for a forward-only
//! [`Model::eval_pass`] ([`Model::swap_adapters`]: no second copy of any weight).
//!
//! Not here: batching, loss normalisation across micro-batches, optimizers (`hf2q-train`).

use hf2q_tensor::train_op::{SeqLayout, TrainBackend};
use hf2q_tensor::Tensor;

use crate::arch::Saved;
use crate::layers::lora::{LoraGrads, TrainCtx};
use crate::model::Model;
use crate::{Error, Result};

/// A packed batch: token ids of every sequence one after another, each row's target (the next
/// token of its sequence to learn, or a negative number for none) and the layout.
pub struct TrainBatch {
    /// (N)
    pub ids: Vec<u32>,
    /// (N)
    pub targets: Vec<i32>,
    pub layout: SeqLayout,
}

impl TrainBatch {
    /// Rows with a target.
    pub fn labelled(&self) -> usize {
        self.targets.iter().filter(|&&t| t >= 0).count()
    }
}

/// How a pass runs.
#[derive(Clone, Copy, Debug)]
pub struct PassOptions {
    /// Blocks, counted from the first, that keep only their input and recompute their forward
    /// in the backward (gradient checkpointing: 0 keeps every block's activations, the number
    /// of blocks or more keeps none). The last blocks are the ones kept: their state is used
    /// first and freed first in the backward.
    pub recompute_blocks: usize,
    /// Adapter dropout on (training) or off.
    pub dropout: bool,
    /// The pass's dropout stream.
    pub seed: u64,
}

/// Per row of the batch: `log p(target)` (0 without a target) and whether the target was the
/// argmax.
#[derive(Clone, Debug, Default)]
pub struct PassOut {
    pub logp: Vec<f32>,
    pub hit: Vec<bool>,
}

/// The loss weights of a pass: known before it, or made from its log-probabilities.
enum Weights<'a> {
    Fixed(&'a [f32]),
    FromLogp(&'a mut dyn FnMut(&PassOut) -> Result<Vec<f32>>),
}

impl Model {
    fn check_batch(&self, b: &TrainBatch) -> Result<()> {
        let n = b.layout.rows();
        if b.ids.len() != n || b.targets.len() != n {
            return Err(Error::Msg(format!(
                "a batch of {n} rows has {} ids and {} targets",
                b.ids.len(),
                b.targets.len()
            )));
        }
        let v = self.vocab_size();
        if let Some(t) = b.targets.iter().find(|&&t| t >= 0 && t as usize >= v) {
            return Err(Error::Msg(format!(
                "target {t} is outside the vocabulary of {v}"
            )));
        }
        Ok(())
    }

    /// The final norm's input `(N, D)` and, per block, its input and (without checkpointing)
    /// its saved state.
    fn forward_blocks(
        &self,
        cx: &TrainCtx,
        ids: &[u32],
        recompute: usize,
    ) -> Result<(Tensor, Vec<(Tensor, Option<Saved>)>)> {
        let be = cx.be;
        let (embed, _, _) = self.ends();
        let mut x = be.embedding(embed, ids, self.config.embed_scale)?;
        let mut inputs = Vec::with_capacity(self.blocks().len());
        for (i, block) in self.blocks().iter().enumerate() {
            let (y, saved) = block.forward_train(cx, &x)?;
            inputs.push((x, (i >= recompute).then_some(saved)));
            x = y;
        }
        Ok((x, inputs))
    }

    /// Forward only (evaluation): the log-probabilities of the targets, no gradient, no
    /// dropout.
    pub fn eval_pass(&self, batch: &TrainBatch) -> Result<PassOut> {
        self.check_batch(batch)?;
        let be = self.train_backend();
        let cx = TrainCtx {
            be,
            layout: &batch.layout,
            dropout: false,
            seed: 0,
        };
        let (x, _) = self.forward_blocks(&cx, &batch.ids, usize::MAX)?;
        let (_, norm, head) = self.ends();
        let h = be.rms_norm(&x, norm, self.config.rms_eps, self.config.norm_offset)?;
        let out = be.lm_head_logprobs(
            &h,
            head,
            &batch.targets,
            self.config.final_logit_softcap,
            None,
        )?;
        Ok(PassOut {
            logp: out.logp,
            hit: out.hit,
        })
    }

    /// Forward and backward of `Σ_n weights_n · log p(target_n)` (see the module header); the
    /// adapters' gradients are added to `grads`.
    pub fn train_pass(
        &self,
        batch: &TrainBatch,
        weights: &[f32],
        opts: &PassOptions,
        grads: &mut LoraGrads,
    ) -> Result<PassOut> {
        self.pass(batch, Weights::Fixed(weights), opts, grads)
    }

    /// [`Model::train_pass`] with weights that depend on the pass's log-probabilities:
    /// `weights(&out)` gets every row's `log p(target)` of this very forward (dropout masks
    /// included) and returns the `(N)` weights to back-propagate.
    pub fn train_pass_with(
        &self,
        batch: &TrainBatch,
        weights: &mut dyn FnMut(&PassOut) -> Result<Vec<f32>>,
        opts: &PassOptions,
        grads: &mut LoraGrads,
    ) -> Result<PassOut> {
        self.pass(batch, Weights::FromLogp(weights), opts, grads)
    }

    /// Swaps the model's adapters with `set` (one slot per `Linear`, in block order; an empty
    /// or short `set` counts as no adapter on the missing slots). Swapping twice restores the
    /// model: `swap_adapters(&mut ref_set); eval; swap_adapters(&mut ref_set)` evaluates under
    /// the reference adapters (an empty set: the bare base) without copying a weight.
    pub fn swap_adapters(&mut self, set: &mut Vec<Option<crate::layers::lora::Lora>>) {
        let mut i = 0;
        for block in self.blocks_mut() {
            for (_, lin) in block.linears_mut() {
                if set.len() <= i {
                    set.push(None);
                }
                std::mem::swap(&mut lin.lora, &mut set[i]);
                i += 1;
            }
        }
    }

    fn pass(
        &self,
        batch: &TrainBatch,
        weights: Weights,
        opts: &PassOptions,
        grads: &mut LoraGrads,
    ) -> Result<PassOut> {
        self.check_batch(batch)?;
        let rows = batch.layout.rows();
        let check = |w: &[f32]| -> Result<()> {
            if w.len() != rows {
                return Err(Error::Msg(format!(
                    "{} loss weights for a batch of {rows} rows",
                    w.len()
                )));
            }
            Ok(())
        };
        if let Weights::Fixed(w) = &weights {
            check(w)?;
        }
        let be: &dyn TrainBackend = self.train_backend();
        let cx = TrainCtx {
            be,
            layout: &batch.layout,
            dropout: opts.dropout,
            seed: opts.seed,
        };
        let (x, mut inputs) = self.forward_blocks(&cx, &batch.ids, opts.recompute_blocks)?;
        let (_, norm, head) = self.ends();
        let (eps, off) = (self.config.rms_eps, self.config.norm_offset);
        let h = be.rms_norm(&x, norm, eps, off)?;
        let softcap = self.config.final_logit_softcap;
        let computed;
        let weights: &[f32] = match weights {
            Weights::Fixed(w) => w,
            Weights::FromLogp(f) => {
                let fwd = be.lm_head_logprobs(&h, head, &batch.targets, softcap, None)?;
                computed = f(&PassOut {
                    logp: fwd.logp,
                    hit: fwd.hit,
                })?;
                check(&computed)?;
                &computed
            }
        };
        let out = be.lm_head_logprobs(&h, head, &batch.targets, softcap, Some(weights))?;
        drop(h);
        let dh = out
            .dh
            .ok_or_else(|| Error::Msg("the output layer returned no gradient".into()))?;
        let mut dx = be.rms_norm_backward(&x, norm, eps, off, &dh)?;
        drop((x, dh));
        // Each block's input and state are dropped as soon as its backward is done.
        for block in self.blocks().iter().rev() {
            let (input, saved) = inputs.pop().expect("one input per block");
            let saved = match saved {
                Some(s) => s,
                None => block.forward_train(&cx, &input)?.1,
            };
            dx = block.backward(&cx, &input, saved, dx, grads)?;
        }
        Ok(PassOut {
            logp: out.logp,
            hit: out.hit,
        })
    }
}
