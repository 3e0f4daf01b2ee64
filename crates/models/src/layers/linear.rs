//! `Linear`: `y = x Wᵀ (+ b) (+ LoRA)`. Dense, quantized and LoRA weights differ only in here:
//! the base weight stays in its stored form (`QTensor`), an optional adapter ([`Lora`]) adds
//! its low-rank term, and the training forward/backward of the layer live beside the inference
//! forward. Served adapters (several on one base, per row of a batch) come through the
//! forward's context ([`Fwd`]) and are found by the product's `site`.

use hf2q_tensor::{QTensor, Tensor};

use crate::layers::lora::{Lora, LoraGrads, LoraSaved, TrainCtx};
use crate::layers::served::Fwd;
use crate::source::WeightSource;
use crate::Result;

pub struct Linear {
    /// (R, C)
    pub w: QTensor,
    /// (R)
    pub b: Option<Vec<f32>>,
    /// A LoRA adapter on this product, when one is attached.
    pub lora: Option<Lora>,
    /// This product's index among the model's products (block by block, in
    /// [`crate::arch::Block::linears`] order): where served adapters keep its factors.
    pub site: usize,
}

/// What [`Linear::forward_train`] keeps for the backward (the input itself is kept by the
/// caller, which often shares it between several products).
pub struct LinearSaved {
    lora: Option<LoraSaved>,
}

impl Linear {
    /// Loads `{stem}.weight` and, when `bias`, `{stem}.bias`.
    pub fn load(src: &WeightSource, stem: &str, bias: bool) -> Result<Linear> {
        let w = src.matrix(&format!("{stem}.weight"))?;
        let b = if bias {
            Some(src.vector(&format!("{stem}.bias"))?)
        } else {
            None
        };
        Ok(Linear {
            w,
            b,
            lora: None,
            site: 0,
        })
    }
    /// `{stem}.weight` (and `{stem}.bias` when `bias`) cut into products of `widths` rows each,
    /// in order (Phi-3's fused `qkv_proj` and `gate_up_proj`).
    pub fn load_split(
        src: &WeightSource,
        stem: &str,
        bias: bool,
        widths: &[usize],
    ) -> Result<Vec<Linear>> {
        let w = src.matrix(&format!("{stem}.weight"))?;
        let total: usize = widths.iter().sum();
        if w.rows != total {
            return Err(crate::Error::Config(format!(
                "'{}' has {} rows, {total} expected",
                w.name, w.rows
            )));
        }
        let b = if bias {
            Some(src.vector(&format!("{stem}.bias"))?)
        } else {
            None
        };
        if b.as_ref().is_some_and(|b| b.len() != total) {
            return Err(crate::Error::Config(format!(
                "'{stem}.bias' has the wrong length"
            )));
        }
        let mut start = 0;
        let mut out = Vec::with_capacity(widths.len());
        for (i, &n) in widths.iter().enumerate() {
            out.push(Linear {
                w: w.row_range(start, n, &format!("{}#{i}", w.name))?,
                b: b.as_ref().map(|b| b[start..start + n].to_vec()),
                lora: None,
                site: 0,
            });
            start += n;
        }
        Ok(out)
    }
    /// Whether the product is the plain stored weight (no bias, no attached adapter): the
    /// only form the backends' fused launches take. Served adapters do not change it: their
    /// terms are added after the base product ([`Linear::add_served`]).
    pub fn is_plain(&self) -> bool {
        self.b.is_none() && self.lora.is_none()
    }
    /// `x (T, C) -> (T, R)`.
    pub fn forward(&self, cx: &Fwd, x: &Tensor) -> Result<Tensor> {
        let be = cx.be;
        let mut y = be.linear(x, &self.w, self.b.as_deref())?;
        if let Some(l) = &self.lora {
            l.forward(be, x, &mut y)?;
        }
        self.add_served(cx, x, &mut y)?;
        Ok(y)
    }
    /// `y (T, R) +=` the served adapters' terms of this product on their rows of `x (T, C)`
    /// (nothing when the batch has none here): after a base product that ran on every row,
    /// fused with others or not.
    pub fn add_served(&self, cx: &Fwd, x: &Tensor, y: &mut Tensor) -> Result<()> {
        match cx.lora {
            Some(b) => b.apply(cx.be, self.site, x, y),
            None => Ok(()),
        }
    }
    /// `residual (T, R) += forward(x)`.
    pub fn forward_add(&self, cx: &Fwd, x: &Tensor, residual: &mut Tensor) -> Result<()> {
        if !self.is_plain() {
            let y = self.forward(cx, x)?;
            return Ok(cx.be.add_assign(residual, &y)?);
        }
        cx.be.linear_add(x, &self.w, residual)?;
        // The served terms straight onto the residual: `r + xWᵀ + Δ`.
        self.add_served(cx, x, residual)
    }

    /// The training forward of `x (N, C) -> (N, R)`: the adapter's input dropout applies; the
    /// base product and the adapter's `B` term are one product where the backend fuses them.
    pub fn forward_train(&self, cx: &TrainCtx, x: &Tensor) -> Result<(Tensor, LinearSaved)> {
        let bias = self.b.as_deref();
        match &self.lora {
            Some(l) => {
                let s = l.project(cx, x)?;
                let y = cx
                    .be
                    .linear_low_rank(x, &self.w, bias, l.xa(&s), &l.b, l.scale)?;
                Ok((y, LinearSaved { lora: Some(s) }))
            }
            None => Ok((cx.be.linear(x, &self.w, bias)?, LinearSaved { lora: None })),
        }
    }

    /// From `dy (N, R)`: the input's gradient `(N, C)` (through the frozen weight and the
    /// adapter), the adapter's gradients accumulated into `grads`.
    pub fn backward(
        &self,
        cx: &TrainCtx,
        x: &Tensor,
        saved: &LinearSaved,
        dy: &Tensor,
        grads: &mut LoraGrads,
    ) -> Result<Tensor> {
        match (&self.lora, &saved.lora) {
            (Some(l), Some(s)) => {
                let dxa = l.backward_factors(cx, x, s, dy, grads)?;
                if l.drops(cx) {
                    let mut dx = cx.be.linear_backward_input(dy, &self.w)?;
                    l.input_grad(cx, &dxa, &mut dx)?;
                    Ok(dx)
                } else {
                    Ok(cx
                        .be
                        .linear_backward_input_low_rank(dy, &self.w, &dxa, &l.a, 1.0)?)
                }
            }
            _ => Ok(cx.be.linear_backward_input(dy, &self.w)?),
        }
    }
}
