//! A LoRA adapter on one `Linear` (PEFT's `LoraLayer`): `y = x Wᵀ + scale · (dropout(x) Aᵀ) Bᵀ`,
//! and what a training pass carries through the layers ([`TrainCtx`]) and collects
//! ([`LoraGrads`]).
//!
//! The factors are f32 tensors where the model's backend keeps its tensors (the host, or the
//! GPU after `Model::set_cuda`). `scale` is `alpha / r`, or `alpha / √r` with rsLoRA. Only the
//! factors are trained; the base weight, its bias and the rest of the model are frozen.
//!
//! Not here: how adapters are made, named, saved or loaded (`crate::adapter`).

use hf2q_tensor::op::MatmulSpec;
use hf2q_tensor::train_op::{SeqLayout, TrainBackend};
use hf2q_tensor::Tensor;

use crate::Result;

pub struct Lora {
    /// (r, C)
    pub a: Tensor,
    /// (R, r)
    pub b: Tensor,
    pub scale: f32,
    /// Dropout probability on the adapter's input while training (PEFT's `lora_dropout`).
    pub dropout: f32,
    /// This adapter's index among the model's adapters: its slot in [`LoraGrads`] and its
    /// dropout stream.
    pub id: usize,
}

impl Lora {
    pub fn rank(&self) -> usize {
        self.a.dims2().0
    }
}

/// What a training forward and backward share across every layer of one pass.
pub struct TrainCtx<'a> {
    pub be: &'a dyn TrainBackend,
    /// The packed batch's sequences.
    pub layout: &'a SeqLayout,
    /// Dropout on (training) or off (evaluation; the mask is also off when every adapter's
    /// probability is 0).
    pub dropout: bool,
    /// This pass's dropout stream: each adapter's mask is drawn from `(seed, adapter id)`.
    pub seed: u64,
}

impl TrainCtx<'_> {
    /// The dropout seed of adapter `id` in this pass.
    pub fn dropout_seed(&self, id: usize) -> u64 {
        self.seed ^ (id as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93)
    }
}

/// Gradients of every adapter's factors, `(dA (r, C), dB (R, r))` by adapter id, accumulated
/// over the micro-batches of a step (made on first use, where the backend keeps tensors).
#[derive(Default)]
pub struct LoraGrads {
    slots: Vec<Option<(Tensor, Tensor)>>,
}

impl LoraGrads {
    pub fn new() -> LoraGrads {
        LoraGrads::default()
    }
    /// The gradient slots of `lora`, zero on first use.
    pub fn slot(&mut self, be: &dyn TrainBackend, lora: &Lora) -> Result<&mut (Tensor, Tensor)> {
        if self.slots.len() <= lora.id {
            self.slots.resize_with(lora.id + 1, || None);
        }
        if self.slots[lora.id].is_none() {
            self.slots[lora.id] = Some((be.zeros(lora.a.shape())?, be.zeros(lora.b.shape())?));
        }
        Ok(self.slots[lora.id].as_mut().expect("made above"))
    }
    /// The gradients of adapter `id`, if any pass reached it.
    pub fn get(&self, id: usize) -> Option<&(Tensor, Tensor)> {
        self.slots.get(id).and_then(Option::as_ref)
    }
    pub fn get_mut(&mut self, id: usize) -> Option<&mut (Tensor, Tensor)> {
        self.slots.get_mut(id).and_then(Option::as_mut)
    }
    /// Drops every gradient (the start of a step).
    pub fn clear(&mut self) {
        self.slots.clear();
    }
    /// Every gradient tensor.
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.slots.iter().flatten().flat_map(|(a, b)| [a, b])
    }
    pub fn tensors_mut(&mut self) -> impl Iterator<Item = &mut Tensor> {
        self.slots.iter_mut().flatten().flat_map(|(a, b)| [a, b])
    }
}

/// What the adapter's forward keeps for its backward.
pub struct LoraSaved {
    /// (N, r) `dropout(x) · Aᵀ`
    xa: Tensor,
}

impl Lora {
    /// `dropout(x) · Aᵀ (N, r)` for `x (N, C)`: the adapter's first factor, what its
    /// forward keeps (the caller adds `scale · xa · Bᵀ` to the base product, in one product
    /// where the backend fuses them: `TrainBackend::linear_low_rank`).
    pub fn project(&self, cx: &TrainCtx, x: &Tensor) -> Result<LoraSaved> {
        let xd = self.dropped(cx, x)?;
        let xa = cx
            .be
            .matmul(xd.as_ref().unwrap_or(x), &self.a, MatmulSpec::NT)?;
        Ok(LoraSaved { xa })
    }

    /// The saved projection (the input of `B`).
    pub fn xa<'s>(&self, saved: &'s LoraSaved) -> &'s Tensor {
        &saved.xa
    }

    /// The inference forward: `y += scale · (x Aᵀ) Bᵀ`.
    pub fn forward(
        &self,
        be: &dyn hf2q_tensor::op::Backend,
        x: &Tensor,
        y: &mut Tensor,
    ) -> Result<()> {
        let xa = be.matmul(x, &self.a, MatmulSpec::NT)?;
        Ok(be.matmul_acc(y, &xa, &self.b, MatmulSpec::NT.scaled(self.scale))?)
    }

    /// Whether this pass draws a dropout mask on the adapter's input.
    pub fn drops(&self, cx: &TrainCtx) -> bool {
        cx.dropout && self.dropout > 0.0
    }

    /// Accumulates `dA`, `dB` from `dy (N, R)` and returns `dxa = scale · dy · B (N, r)`, the
    /// gradient of the projection: `dB += s dyᵀ xa`, `dA += dxaᵀ dropout(x)`. The input's
    /// gradient through the adapter is `mask(dxa · A)` ([`Lora::input_grad`]).
    pub fn backward_factors(
        &self,
        cx: &TrainCtx,
        x: &Tensor,
        saved: &LoraSaved,
        dy: &Tensor,
        grads: &mut LoraGrads,
    ) -> Result<Tensor> {
        let be = cx.be;
        let xd = self.dropped(cx, x)?;
        let (da, db) = grads.slot(be, self)?;
        be.matmul_acc(db, dy, &saved.xa, MatmulSpec::TN.scaled(self.scale))?;
        let dxa = be.matmul(dy, &self.b, MatmulSpec::NN.scaled(self.scale))?;
        be.matmul_acc(da, &dxa, xd.as_ref().unwrap_or(x), MatmulSpec::TN)?;
        Ok(dxa)
    }

    /// `dx += mask(dxa · A)`: the adapter's part of the input's gradient, for passes with
    /// dropout (without it the backend folds `dxa · A` into the base product's backward).
    pub fn input_grad(&self, cx: &TrainCtx, dxa: &Tensor, dx: &mut Tensor) -> Result<()> {
        let be = cx.be;
        let part = be.matmul(dxa, &self.a, MatmulSpec::NN)?;
        let masked = be.dropout(&part, self.dropout, cx.dropout_seed(self.id))?;
        Ok(be.add_assign(dx, &masked)?)
    }

    /// `dropout(x)` when it applies in this pass (`None`: the input as it is).
    fn dropped(&self, cx: &TrainCtx, x: &Tensor) -> Result<Option<Tensor>> {
        if cx.dropout && self.dropout > 0.0 {
            Ok(Some(cx.be.dropout(
                x,
                self.dropout,
                cx.dropout_seed(self.id),
            )?))
        } else {
            Ok(None)
        }
    }
}
