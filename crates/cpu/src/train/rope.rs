//! RoPE at per-row positions (the rows of a packed batch restart at 0 with each sequence), and
//! its backward: the same rotation by the opposite angle.
//!
//! Angles follow `CpuBackend::rope`: `pos / linear_scale · inv_freq_i`, pairs `(i, i + dims/2)`
//! (NEOX) or `(2i, 2i + 1)` (interleaved).

use rayon::prelude::*;

use hf2q_tensor::op::{RopeParams, RopeStyle};
use hf2q_tensor::train_op::SeqLayout;
use hf2q_tensor::{Result, Tensor};

/// Rotates `x (N, nh*Dh)` in place; `inverse` rotates by `-angle`.
pub fn rope_rows(
    x: &mut Tensor,
    n_heads: usize,
    layout: &SeqLayout,
    p: &RopeParams,
    inverse: bool,
) -> Result<()> {
    layout.check(x, "rope")?;
    let (_, width) = x.dims2();
    let dh = hf2q_tensor::op::check_rope(x, n_heads, p)?;
    let inv = p.inv_freqs();
    let half = p.dims / 2;
    let sign = if inverse { -1.0f32 } else { 1.0 };
    let positions = layout.positions();
    x.data_mut()
        .par_chunks_mut(width)
        .enumerate()
        .for_each(|(ti, row)| {
            let pos = positions[ti] as f32 / p.linear_scale;
            let cs: Vec<(f32, f32)> = inv
                .iter()
                .map(|f| {
                    let a = pos * f;
                    (a.cos(), sign * a.sin())
                })
                .collect();
            for head in row.chunks_mut(dh) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = match p.style {
                        RopeStyle::Neox => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c - x1 * s;
                    head[b] = x0 * s + x1 * c;
                }
            }
        });
    Ok(())
}
