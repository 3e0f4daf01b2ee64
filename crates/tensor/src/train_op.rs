//! The op set of training: [`TrainBackend`] adds to [`Backend`] the forward forms that keep what
//! their backward needs (attention's log-sum-exp, RoPE at per-row positions) and the backward of
//! every op a block uses, each with the shape contract of its forward. A block's backward
//! composes these in reverse (llm.c's way); there is no tape.
//!
//! What is not here: gradients of frozen weights (embedding table, norms and the base weights of
//! `linear` get none: LoRA trains only its own factors, through [`Backend::matmul`]), and any
//! notion of a model or an adapter.
//!
//! Shapes (letters as in `op.rs`): N rows of a packed batch (all sequences one after another),
//! D model width, H query heads, Hkv key/value heads, Dh head width, R/C a weight's output/input
//! features, V vocabulary.

use std::any::Any;
use std::sync::{Arc, OnceLock};

use crate::op::{AttentionParams, Backend, GateAct, MatmulSpec, RopeParams};
use crate::{Error, QTensor, Result, Tensor};

/// Where each sequence of a packed batch starts: sequence `s` holds rows
/// `starts[s]..starts[s + 1]` (flash-attention's `cu_seqlens`), its positions count from 0, and
/// attention never crosses from one sequence into another. A ragged batch and a packed one are
/// the same thing here: no row is padding.
pub struct SeqLayout {
    /// S + 1 row offsets, from 0 to N, non-decreasing.
    starts: Vec<usize>,
    /// (N) position of each row within its sequence.
    positions: Vec<u32>,
    /// (N) the sequence each row belongs to.
    seq_of: Vec<u32>,
    /// A backend's own copy of the layout (a GPU's upload), made on its first use.
    pub device: OnceLock<Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for SeqLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SeqLayout({:?})", self.lengths().collect::<Vec<_>>())
    }
}

impl SeqLayout {
    /// Sequences of these lengths, one after another; an empty sequence is an error.
    pub fn from_lengths(lengths: &[usize]) -> Result<SeqLayout> {
        if lengths.is_empty() || lengths.contains(&0) {
            return Err(Error::Shape(format!(
                "a packed batch needs sequences of at least one token, got lengths {lengths:?}"
            )));
        }
        let n: usize = lengths.iter().sum();
        if n > u32::MAX as usize {
            return Err(Error::Shape(format!("a packed batch of {n} rows")));
        }
        let mut starts = Vec::with_capacity(lengths.len() + 1);
        let mut positions = Vec::with_capacity(n);
        let mut seq_of = Vec::with_capacity(n);
        starts.push(0);
        for (s, &len) in lengths.iter().enumerate() {
            positions.extend(0..len as u32);
            seq_of.extend(std::iter::repeat_n(s as u32, len));
            starts.push(starts[s] + len);
        }
        Ok(SeqLayout {
            starts,
            positions,
            seq_of,
            device: OnceLock::new(),
        })
    }
    /// N: rows in all.
    pub fn rows(&self) -> usize {
        *self.starts.last().unwrap_or(&0)
    }
    /// S: sequences.
    pub fn sequences(&self) -> usize {
        self.starts.len() - 1
    }
    /// The S + 1 row offsets.
    pub fn starts(&self) -> &[usize] {
        &self.starts
    }
    /// (N) position of each row in its sequence.
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }
    /// (N) index of each row's sequence.
    pub fn seq_of(&self) -> &[u32] {
        &self.seq_of
    }
    /// Rows `lo..hi` of the sequence holding `row`: the keys row `row` may attend to under a
    /// causal mask and an optional window (keys at distance >= window are masked).
    pub fn visible(&self, row: usize, window: Option<usize>) -> (usize, usize) {
        let start = self.starts[self.seq_of[row] as usize];
        let lo = match window {
            Some(w) => start.max((row + 1).saturating_sub(w)),
            None => start,
        };
        (lo, row + 1)
    }
    pub fn lengths(&self) -> impl Iterator<Item = usize> + '_ {
        self.starts.windows(2).map(|w| w[1] - w[0])
    }
    /// Checks that a tensor has one row per row of the layout.
    pub fn check(&self, x: &Tensor, what: &str) -> Result<()> {
        if x.dims2().0 != self.rows() {
            return Err(Error::Shape(format!(
                "{what}: {} rows for a batch of {} rows",
                x.dims2().0,
                self.rows()
            )));
        }
        Ok(())
    }
}

/// Attention of a training forward: [`AttentionParams`] plus the scores' soft cap
/// (`cap · tanh(s / cap)` before the softmax, where the family has one).
#[derive(Clone, Debug)]
pub struct TrainAttention {
    pub p: AttentionParams,
    pub softcap: Option<f32>,
}

/// What [`TrainBackend::attention_train`] returns: the output and what its backward needs.
pub struct AttentionOut {
    /// (N, H*Dh)
    pub out: Tensor,
    /// (N, H) log-sum-exp of each row's scaled scores (natural log).
    pub lse: Tensor,
}

/// Gradients of attention's three inputs.
pub struct AttentionGrads {
    /// (N, H*Dh)
    pub dq: Tensor,
    /// (N, Hkv*Dh)
    pub dk: Tensor,
    /// (N, Hkv*Dh)
    pub dv: Tensor,
}

/// The output layer and the loss together ([`TrainBackend::lm_head_logprobs`]).
pub struct HeadOut {
    /// (N) log p(target) of each row; 0 for rows without a target.
    pub logp: Vec<f32>,
    /// (N) whether the target is the row's argmax (false without a target).
    pub hit: Vec<bool>,
    /// (N, D) `∂(Σ_n g_n · logp_n) / ∂h` when weights `g` were given.
    pub dh: Option<Tensor>,
}

/// One AdamW update (PyTorch's `torch.optim.AdamW`, decoupled weight decay): `step` counts from
/// 1 (bias corrections `1 - β^step`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub step: u64,
}

/// The training op set (see the module header). Every tensor argument lives where this backend
/// keeps its tensors; `rows` of a [`SeqLayout`] is N.
pub trait TrainBackend: Backend {
    /// This backend as the inference op set.
    fn as_backend(&self) -> &dyn Backend;

    /// RoPE of `x (N, nh*Dh)` in place at each row's position in its sequence; `inverse`
    /// rotates by the opposite angle, which is RoPE's backward (a rotation's transpose).
    fn rope_rows(
        &self,
        x: &mut Tensor,
        n_heads: usize,
        layout: &SeqLayout,
        p: &RopeParams,
        inverse: bool,
    ) -> Result<()>;

    /// Causal attention of `q (N, H*Dh)` over `k, v (N, Hkv*Dh)` within each sequence of
    /// `layout`, keeping the log-sum-exp of every row's scores for the backward.
    fn attention_train(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        layout: &SeqLayout,
        a: &TrainAttention,
    ) -> Result<AttentionOut>;

    /// The backward of [`TrainBackend::attention_train`] from `dout (N, H*Dh)`, recomputing the
    /// probabilities from `lse` block by block (flash-attention 2's backward: no N x N matrix
    /// is ever stored).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        fwd: &AttentionOut,
        dout: &Tensor,
        layout: &SeqLayout,
        a: &TrainAttention,
    ) -> Result<AttentionGrads>;

    /// The backward of `rms_norm(x, w, eps, offset)` with respect to `x (rows, C)` (the norm's
    /// weight is frozen).
    fn rms_norm_backward(
        &self,
        x: &Tensor,
        w: &[f32],
        eps: f32,
        offset: f32,
        dy: &Tensor,
    ) -> Result<Tensor>;

    /// The backward of `act(gate) * up` (`silu_mul`, `gelu_tanh_mul`): `(dgate, dup)`.
    fn gated_act_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        dy: &Tensor,
        act: GateAct,
    ) -> Result<(Tensor, Tensor)>;

    /// `dy (N, R) · W (R, C) -> (N, C)`: the gradient of `linear`'s input through a frozen
    /// weight of any stored format (dequantized on the fly, as the forward reads it).
    fn linear_backward_input(&self, dy: &Tensor, w: &QTensor) -> Result<Tensor>;

    /// `x (N, C) · Wᵀ (+ bias) + scale · u · Bᵀ`, `u (N, r)`, `B (R, r)`: a product through a
    /// frozen weight plus a low-rank term (a LoRA adapter's `B (A x)`, `u` computed by the
    /// caller). The default composes [`Backend::linear`] and [`Backend::matmul_acc`]; a GPU
    /// appends the term along the product's depth, so one product does both and the (N, R)
    /// output is written once.
    #[allow(clippy::too_many_arguments)]
    fn linear_low_rank(
        &self,
        x: &Tensor,
        w: &QTensor,
        bias: Option<&[f32]>,
        u: &Tensor,
        b: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        let mut y = self.linear(x, w, bias)?;
        self.matmul_acc(&mut y, u, b, MatmulSpec::NT.scaled(scale))?;
        Ok(y)
    }

    /// `dy (N, R) · W + scale · du · A`, `du (N, r)`, `A (r, C)`: the input gradient of
    /// [`TrainBackend::linear_low_rank`] when the low-rank path reads the same `x` (no dropout
    /// between them). The default composes [`TrainBackend::linear_backward_input`] and
    /// [`Backend::matmul_acc`].
    fn linear_backward_input_low_rank(
        &self,
        dy: &Tensor,
        w: &QTensor,
        du: &Tensor,
        a: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        let mut dx = self.linear_backward_input(dy, w)?;
        self.matmul_acc(&mut dx, du, a, MatmulSpec::NN.scaled(scale))?;
        Ok(dx)
    }

    /// `x` with each element zeroed with probability `p` and the rest scaled by `1 / (1 - p)`,
    /// the mask a pure function of `(seed, element index)` (so a backward recomputes it, and
    /// every backend draws the same mask).
    fn dropout(&self, x: &Tensor, p: f32, seed: u64) -> Result<Tensor>;

    /// The output layer `logits = h · Wᵀ (N, V)` (soft-capped when `softcap`), its log-softmax
    /// at `targets` (`< 0`: no target), and with `grad = Some(g)` the gradient of
    /// `Σ_n g_n · logp_n` with respect to `h (N, D)`; in row chunks, so the (N, V) logits are
    /// never held at once.
    fn lm_head_logprobs(
        &self,
        h: &Tensor,
        w: &QTensor,
        targets: &[i32],
        softcap: Option<f32>,
        grad: Option<&[f32]>,
    ) -> Result<HeadOut>;

    /// `x += alpha · y` (same shapes).
    fn add_scaled(&self, x: &mut Tensor, y: &Tensor, alpha: f32) -> Result<()>;
    /// `x *= s`.
    fn scale(&self, x: &mut Tensor, s: f32) -> Result<()>;
    /// `Σ x²` in f64 (gradient norms).
    fn sum_squares(&self, x: &Tensor) -> Result<f64>;
    /// Zeros of this shape, where this backend keeps its tensors.
    fn zeros(&self, shape: &[usize]) -> Result<Tensor>;
    /// One AdamW update of `param` from `grad`, with its moments `m` and `v` (all the same shape).
    fn adamw(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        s: &AdamStep,
    ) -> Result<()>;
}

/// Checks an RMSNorm backward (every backend's): `x` and `dy` of one shape `(rows, C)`, `w`
/// of C values. Returns `(rows, C)`.
pub fn check_norm_backward(x: &Tensor, w: &[f32], dy: &Tensor) -> Result<(usize, usize)> {
    crate::op::same_shape(x, dy, "rms_norm_backward")?;
    let (rows, c) = x.dims2();
    if w.len() != c {
        return Err(Error::Shape(format!(
            "rms_norm_backward: weight has {} values, rows have {c}",
            w.len()
        )));
    }
    Ok((rows, c))
}

/// The mask value of element `i` under `(seed, p)`: keep (true) with probability `1 - p`. A
/// counter-based hash (SplitMix64's finalizer over `seed ^ i·φ`), the same on every backend.
#[inline]
pub fn dropout_keep(seed: u64, i: u64, p: f32) -> bool {
    let mut z = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    // The top 24 bits as a uniform number in [0, 1).
    let u = (z >> 40) as f32 * (1.0 / (1u64 << 24) as f32);
    u >= p
}

/// Checks q, k, v against the layout and the heads; returns (H, Hkv, Dh) (every backend's
/// check).
pub fn check_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    layout: &SeqLayout,
    a: &TrainAttention,
) -> Result<(usize, usize, usize)> {
    let p = &a.p;
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    if hkv == 0 || dh == 0 || h % hkv != 0 {
        return Err(Error::Shape(format!(
            "attention: {h} heads in {hkv} kv groups of width {dh}"
        )));
    }
    if p.sinks.is_some() {
        return Err(Error::Msg(
            "training attention with sinks (GPT-OSS) is not supported yet".into(),
        ));
    }
    for (t, width, what) in [(q, h * dh, "q"), (k, hkv * dh, "k"), (v, hkv * dh, "v")] {
        layout.check(t, what)?;
        if t.dims2().1 != width {
            return Err(Error::Shape(format!(
                "attention: {what} rows have {} values, {width} expected",
                t.dims2().1
            )));
        }
    }
    if let Some(w) = p.window {
        if w == 0 {
            return Err(Error::Shape("attention: a window of 0 keys".into()));
        }
    }
    Ok((h, hkv, dh))
}

/// Checks the targets and gradient weights of `n` rows against a vocabulary of `vocab` (every
/// backend's check).
pub fn check_head(n: usize, vocab: usize, targets: &[i32], grad: Option<&[f32]>) -> Result<()> {
    if targets.len() != n || grad.is_some_and(|g| g.len() != n) {
        return Err(Error::Shape(format!(
            "lm head: {n} rows, {} targets, {:?} gradient weights",
            targets.len(),
            grad.map(<[f32]>::len)
        )));
    }
    if let Some(&bad) = targets.iter().find(|&&t| t >= 0 && t as usize >= vocab) {
        return Err(Error::Shape(format!(
            "lm head: target {bad} is outside the vocabulary of {vocab}"
        )));
    }
    Ok(())
}

/// The scalars of one AdamW step, in the order `torch.optim.AdamW` (single-tensor, not fused)
/// computes them, so that an update rounds as PyTorch's does.
pub struct AdamCoefficients {
    pub decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub step_size: f32,
    pub bias2_sqrt: f32,
    pub eps: f32,
}

impl AdamCoefficients {
    pub fn new(s: &AdamStep) -> AdamCoefficients {
        let t = s.step.max(1) as i32;
        let bias1 = 1.0 - (s.beta1 as f64).powi(t);
        let bias2 = 1.0 - (s.beta2 as f64).powi(t);
        AdamCoefficients {
            decay: 1.0 - s.lr * s.weight_decay,
            beta1: s.beta1,
            beta2: s.beta2,
            step_size: (s.lr as f64 / bias1) as f32,
            bias2_sqrt: bias2.sqrt() as f32,
            eps: s.eps,
        }
    }
    /// `p *= 1 − lr·wd; m = lerp(m, g, 1 − β1); v = β2 v + (1 − β2) g²;
    /// p −= step_size · m / (√v / √(1 − β2^t) + eps)`.
    #[inline]
    pub fn update(&self, p: &mut f32, g: f32, m: &mut f32, v: &mut f32) {
        *p *= self.decay;
        *m += (g - *m) * (1.0 - self.beta1);
        *v = *v * self.beta2 + (1.0 - self.beta2) * g * g;
        let denom = v.sqrt() / self.bias2_sqrt + self.eps;
        *p -= self.step_size * (*m / denom);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_rows_positions_and_visibility() {
        let l = SeqLayout::from_lengths(&[3, 1, 2]).unwrap();
        assert_eq!(l.rows(), 6);
        assert_eq!(l.sequences(), 3);
        assert_eq!(l.positions(), &[0, 1, 2, 0, 0, 1]);
        assert_eq!(l.visible(2, None), (0, 3));
        assert_eq!(l.visible(3, None), (3, 4));
        assert_eq!(l.visible(5, None), (4, 6));
        assert_eq!(l.visible(2, Some(2)), (1, 3));
        assert_eq!(l.visible(5, Some(1)), (5, 6));
        assert!(SeqLayout::from_lengths(&[2, 0]).is_err());
        assert!(SeqLayout::from_lengths(&[]).is_err());
    }

    #[test]
    fn dropout_mask_rate() {
        let kept = (0..100_000u64)
            .filter(|&i| dropout_keep(42, i, 0.25))
            .count();
        // Binomial(100000, 0.75): sd 137, so 5 sd is about 700.
        assert!((kept as i64 - 75_000).abs() < 700, "{kept}");
        assert!((0..1000u64).all(|i| dropout_keep(7, i, 0.0)));
    }
}
