//! The output layer fused with the log-softmax at each row's target, chunked over rows (the
//! Liger / cut-cross-entropy idea): only rows that have a target are computed, a chunk of at
//! most [`HEAD_CHUNK_VALUES`] logits exists at a time, and its gradient overwrites it in place
//! before the product back through the weight. The (N, V) logits never exist in full.
//!
//! Per row with target `t` (`z` the logits, soft-capped `z = cap · tanh(z_raw / cap)` when the
//! model caps them): `logp = z_t − logsumexp(z)`, and with weight `g`,
//! `∂(g · logp)/∂z_j = g (δ_jt − softmax_j)`, times `1 − tanh²(z_raw / cap)` under a cap.

use rayon::prelude::*;

use hf2q_tensor::train_op::{check_head, HeadOut};
use hf2q_tensor::{Error, Result, Tensor};

/// Logits held at once: 8 Mi values (32 MiB), e.g. 170 rows of a 49k vocabulary.
pub const HEAD_CHUNK_VALUES: usize = 8 << 20;

/// Soft-caps one row of logits in place; returns `(logp of target, target is the argmax)` and,
/// with `g`, leaves `∂(g · logp)/∂z_raw` in `z`.
pub fn row_logprob(
    z: &mut [f32],
    target: usize,
    softcap: Option<f32>,
    g: Option<f32>,
) -> (f32, bool) {
    if let Some(cap) = softcap {
        z.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
    }
    // The first of equal maxima is the argmax (as the sampler's argmax).
    let (mut best, mut m) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in z.iter().enumerate() {
        if v > m {
            m = v;
            best = i;
        }
    }
    // Summed in f64: an f32 running sum over a 50k-200k vocabulary drifts low by ~1e-4
    // relative (measured: SmolLM2's log-probabilities 1.5e-4 above PyTorch's).
    let sum: f64 = z.iter().map(|v| (v - m).exp() as f64).sum();
    let lse = m + sum.ln() as f32;
    let logp = z[target] - lse;
    if let Some(g) = g {
        for (j, v) in z.iter_mut().enumerate() {
            let p = (*v - lse).exp();
            let d = g * ((j == target) as u8 as f32 - p);
            *v = match softcap {
                // v is the capped value here: 1 - tanh² = 1 - (v / cap)².
                Some(cap) => d * (1.0 - (*v / cap) * (*v / cap)),
                None => d,
            };
        }
    }
    (logp, best == target)
}

/// The whole op over a backend's two products: `logits(h_rows) -> (rows, V)` and
/// `back(dz_rows (rows, V)) -> (rows, D)`. `vocab` bounds the targets.
pub fn lm_head_chunked(
    h: &Tensor,
    vocab: usize,
    targets: &[i32],
    softcap: Option<f32>,
    grad: Option<&[f32]>,
    logits: &dyn Fn(&Tensor) -> Result<Tensor>,
    back: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Result<HeadOut> {
    let (n, d) = h.dims2();
    check_head(n, vocab, targets, grad)?;
    let rows: Vec<usize> = (0..n).filter(|&i| targets[i] >= 0).collect();
    let mut logp = vec![0f32; n];
    let mut hit = vec![false; n];
    let mut dh = grad.map(|_| vec![0f32; n * d]);
    let chunk = (HEAD_CHUNK_VALUES / vocab.max(1)).max(1);
    let hd = h.data();
    for part in rows.chunks(chunk) {
        let mut x = Vec::with_capacity(part.len() * d);
        for &r in part {
            x.extend_from_slice(&hd[r * d..(r + 1) * d]);
        }
        let mut z = logits(&Tensor::new(&[part.len(), d], x)?)?;
        if z.dims2() != (part.len(), vocab) {
            return Err(Error::Shape(format!(
                "lm head: logits of shape {:?} for {} rows of a {vocab} vocabulary",
                z.shape(),
                part.len()
            )));
        }
        let res: Vec<(f32, bool)> = z
            .data_mut()
            .par_chunks_mut(vocab)
            .zip(part.par_iter())
            .map(|(row, &r)| row_logprob(row, targets[r] as usize, softcap, grad.map(|g| g[r])))
            .collect();
        for (&r, (lp, ok)) in part.iter().zip(res) {
            logp[r] = lp;
            hit[r] = ok;
        }
        if let Some(dh) = dh.as_mut() {
            let back_rows = back(&z)?;
            for (i, &r) in part.iter().enumerate() {
                dh[r * d..(r + 1) * d].copy_from_slice(back_rows.row(i));
            }
        }
    }
    Ok(HeadOut {
        logp,
        hit,
        dh: dh.map(|v| Tensor::new(&[n, d], v)).transpose()?,
    })
}
