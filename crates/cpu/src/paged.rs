//! Attention over a paged KV cache on the host: the CPU twin of the device's paged attention
//! (`hf2q_cuda::paged`) and the reference its kernels are tested against.
//!
//! A layer's keys and values are `(n_blocks, Hkv, B, Dh)` arrays ([`PagedLayout`], stored in a
//! [`HostPagedLayer`]); a batch of query rows, each of its own sequence and position, reads them
//! through the sequences' block tables ([`PagedRows`]). The arithmetic is plain f32 (scores, a
//! max-subtracted softmax, the weighted sum of values), rows in parallel. Not here: the storage
//! and its writes, which blocks a sequence holds (`hf2q_tensor::paged`), or when to write (the
//! model's step).

use rayon::prelude::*;

use hf2q_tensor::op::{AttentionParams, KvScalar};
use hf2q_tensor::paged::{HostPagedLayer, PagedElem, PagedLayout, PagedRows};
use hf2q_tensor::{Error, Result};

/// Causal attention of the rows `q (R, H*Dh)` over a host layer -> `(R, H*Dh)`.
pub fn attention<T: PagedElem>(
    layer: &HostPagedLayer<T>,
    q: &[f32],
    rows: &PagedRows<'_>,
    p: &AttentionParams,
) -> Result<Vec<f32>> {
    paged_attention(q, &layer.k, &layer.v, &layer.layout, rows, p)
}

/// Causal attention of `q (R, H*Dh)` over a paged layer `k, v` -> `(R, H*Dh)`: row `r` (of
/// sequence `rows.seq[r]` at position `rows.pos[r]`) sees that sequence's keys `j <= pos`, and
/// with a window `W` those with `pos - j < W`; a padding row (`pos < 0`) is zeros.
pub fn paged_attention<T: KvScalar>(
    q: &[f32],
    k: &[T],
    v: &[T],
    layout: &PagedLayout,
    rows: &PagedRows<'_>,
    p: &AttentionParams,
) -> Result<Vec<f32>> {
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    if hkv == 0 || !h.is_multiple_of(hkv) || hkv != layout.n_kv_heads || dh != layout.head_dim {
        return Err(Error::Shape(format!(
            "paged attention: {h} heads over {hkv} kv heads of {dh}, the pool has {} of {}",
            layout.n_kv_heads, layout.head_dim
        )));
    }
    if p.window == Some(0) {
        return Err(Error::Shape(
            "paged attention: a window of 0 sees no key".into(),
        ));
    }
    let n = layout.elements();
    if k.len() != n || v.len() != n {
        return Err(Error::Shape(format!(
            "paged attention: pool arrays of {} and {} for a layout of {n}",
            k.len(),
            v.len()
        )));
    }
    let width = h * dh;
    if q.len() != rows.pos.len() * width {
        return Err(Error::Shape(format!(
            "paged attention: {} query values for {} rows of {width}",
            q.len(),
            rows.pos.len()
        )));
    }
    rows.check(layout)?;
    hf2q_tensor::op::check_sinks(p)?;
    let group = h / hkv;
    let mut out = vec![0.0f32; q.len()];
    out.par_chunks_mut(width).enumerate().for_each(|(r, orow)| {
        let Ok(pos) = usize::try_from(rows.pos[r]) else {
            return; // padding
        };
        let table = &rows.tables[rows.seq[r] as usize * rows.max_blocks..];
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let mut scores = vec![0.0f32; pos + 1 - lo];
        for head in 0..h {
            let kvh = head / group;
            let qh = &q[r * width + head * dh..][..dh];
            let key_row = |j: usize| {
                let block = table[j / layout.block_tokens] as usize;
                layout.row(block, kvh, j % layout.block_tokens)
            };
            for (s, j) in scores.iter_mut().zip(lo..=pos) {
                let kr = &k[key_row(j)..][..dh];
                let dot: f32 = qh.iter().zip(kr).map(|(a, b)| a * b.to_f32()).sum();
                *s = dot * p.scale;
            }
            // A sink (GPT-OSS) joins the max and the denominator only.
            let sink = p.sink(head);
            let m = scores.iter().copied().fold(sink, f32::max);
            let mut sum = if sink == f32::NEG_INFINITY {
                0.0f32
            } else {
                (sink - m).exp()
            };
            for s in scores.iter_mut() {
                *s = (*s - m).exp();
                sum += *s;
            }
            let oh = &mut orow[head * dh..][..dh];
            for (&w, j) in scores.iter().zip(lo..=pos) {
                let vr = &v[key_row(j)..][..dh];
                for (o, x) in oh.iter_mut().zip(vr) {
                    *o += w * x.to_f32();
                }
            }
            oh.iter_mut().for_each(|o| *o /= sum);
        }
    });
    Ok(out)
}
