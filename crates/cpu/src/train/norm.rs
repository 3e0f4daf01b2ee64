//! RMSNorm's backward with respect to its input (the weight is frozen).
//!
//! Forward (`CpuBackend::rms_norm`): `y = x · inv · w'` with `inv = 1 / sqrt(mean(x²) + eps)`
//! and `w' = w + offset` (Gemma's (1 + w)). Backward, per row of C values:
//! `dx = inv · (dy ∘ w') − x · inv³ / C · Σ(dy ∘ w' ∘ x)`.

use rayon::prelude::*;

use hf2q_tensor::{Result, Tensor};

/// `x, dy (rows, C)`, `w (C)` -> `dx (rows, C)`.
pub fn rms_norm_backward(
    x: &Tensor,
    w: &[f32],
    eps: f32,
    offset: f32,
    dy: &Tensor,
) -> Result<Tensor> {
    let (_, c) = hf2q_tensor::train_op::check_norm_backward(x, w, dy)?;
    let mut dx = vec![0f32; x.len()];
    dx.par_chunks_mut(c.max(1))
        .zip(x.data().par_chunks(c.max(1)))
        .zip(dy.data().par_chunks(c.max(1)))
        .for_each(|((o, xr), gr)| {
            let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / c as f32;
            let inv = 1.0 / (ss + eps).sqrt();
            let dot: f32 = xr
                .iter()
                .zip(gr)
                .zip(w)
                .map(|((xv, g), wv)| g * (wv + offset) * xv)
                .sum();
            let k = inv * inv * inv * dot / c as f32;
            for ((ov, (xv, g)), wv) in o.iter_mut().zip(xr.iter().zip(gr)).zip(w) {
                *ov = inv * g * (wv + offset) - xv * k;
            }
        });
    Tensor::new(x.shape(), dx)
}
