//! Attention over a paged KV cache on the host: the CPU twin of the device's paged attention
//! (`hf2q_cuda::paged`) and the reference its kernels are tested against.
//!
//! A layer's keys and values are `(n_blocks, Hkv, B, Dh)` arrays ([`PagedLayout`], stored in a
//! [`HostPagedLayer`]); a batch of query rows, each of its own sequence and position, reads them
//! through the sequences' block tables ([`PagedRows`]). Two forms:
//! - [`attention`], what the model's step runs: each run of rows of one sequence at consecutive
//!   positions (a prefill chunk, or one decode row) gathers that sequence's keys and values once
//!   into one contiguous `(Hkv, S, Dh)` cache, and every row of it runs the one-row (decode)
//!   kernel of `attention.rs` (SIMD) at its own position. Not the tiled prefill kernel: a row's
//!   result must not depend on the rows beside it (a preempted sequence recomputed in a chunk, a
//!   shared prefix block, must give the bits its decode step gave);
//! - [`paged_attention`], the plain f32 reference (scores, a max-subtracted softmax, the weighted
//!   sum of values, rows in parallel), also the fallback for rows in any other arrangement.
//!
//! Not here: the storage and its writes, which blocks a sequence holds (`hf2q_tensor::paged`),
//! or when to write (the model's step).

use rayon::prelude::*;

use hf2q_tensor::op::{AttentionParams, KvScalar, LayerCache};
use hf2q_tensor::paged::{HostPagedLayer, PagedElem, PagedLayout, PagedRows, RowRun};
use hf2q_tensor::{Error, Result, Tensor};

use crate::KvRead;

/// Causal attention of the rows `q (R, H*Dh)` over a host layer -> `(R, H*Dh)`, as
/// [`paged_attention`] defines it, through the dense kernels (module header).
pub fn attention<T: PagedElem + KvRead>(
    layer: &HostPagedLayer<T>,
    q: &[f32],
    rows: &PagedRows<'_>,
    p: &AttentionParams,
) -> Result<Vec<f32>> {
    let (k, v, layout) = (&layer.k[..], &layer.v[..], &layer.layout);
    check(q, k, v, layout, rows, p)?;
    let width = p.n_heads * p.head_dim;
    let runs = rows.runs();
    // Each row through the one-row kernel at its own position, whatever run it is in: a row's
    // output then never depends on the rows beside it (a preempted sequence's recomputed rows,
    // or shared prefix blocks, give the bits a decode step gave).
    let outs: Vec<Result<Vec<f32>>> = runs
        .par_iter()
        .map(|run| {
            let (kc, vc) = gather(k, v, layout, rows, run);
            let cache = LayerCache {
                k: &kc,
                v: &vc,
                capacity: run.pos0 + run.n,
                centre: None,
            };
            let rows_out: Vec<Result<Vec<f32>>> = (0..run.n)
                .into_par_iter()
                .map(|i| {
                    let r = run.row + i;
                    let qr = Tensor::new(&[1, width], q[r * width..(r + 1) * width].to_vec())?;
                    Ok(crate::attention::attention(&qr, &cache, run.pos0 + i, p)?.into_data())
                })
                .collect();
            let mut o = Vec::with_capacity(run.n * width);
            for row in rows_out {
                o.extend(row?);
            }
            Ok(o)
        })
        .collect();
    let mut out = vec![0.0f32; q.len()];
    for (run, o) in runs.iter().zip(outs) {
        out[run.row * width..(run.row + run.n) * width].copy_from_slice(&o?);
    }
    Ok(out)
}

/// A run's sequence's keys and values at positions `0..pos0 + n`, each as `(Hkv, S, Dh)`
/// (S = pos0 + n), copied a block's rows at a time from the pool.
fn gather<T: Copy + Default>(
    k: &[T],
    v: &[T],
    layout: &PagedLayout,
    rows: &PagedRows<'_>,
    run: &RowRun,
) -> (Vec<T>, Vec<T>) {
    let (hkv, dh, bt) = (layout.n_kv_heads, layout.head_dim, layout.block_tokens);
    let s_len = run.pos0 + run.n;
    let table = &rows.tables[run.seq * rows.max_blocks..][..rows.max_blocks];
    let mut kc = vec![T::default(); hkv * s_len * dh];
    let mut vc = vec![T::default(); hkv * s_len * dh];
    for (b, &block) in table.iter().enumerate().take(s_len.div_ceil(bt)) {
        let first = b * bt;
        let count = bt.min(s_len - first);
        for g in 0..hkv {
            let src = layout.row(block as usize, g, 0);
            let dst = (g * s_len + first) * dh;
            kc[dst..dst + count * dh].copy_from_slice(&k[src..src + count * dh]);
            vc[dst..dst + count * dh].copy_from_slice(&v[src..src + count * dh]);
        }
    }
    (kc, vc)
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
    check(q, k, v, layout, rows, p)?;
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    let width = h * dh;
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

/// The shapes [`paged_attention`] and [`attention`] take: heads against the pool, the pool's
/// arrays, the query rows, every row's table and block ids, the sinks; an error names what is off.
fn check<T>(
    q: &[f32],
    k: &[T],
    v: &[T],
    layout: &PagedLayout,
    rows: &PagedRows<'_>,
    p: &AttentionParams,
) -> Result<()> {
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
    hf2q_tensor::op::check_sinks(p)
}
