//! Attention of a training forward over a packed batch, and its backward, on the CPU: causal
//! within each sequence of the [`SeqLayout`], grouped KV heads, an optional sliding window and
//! an optional soft cap of the scores. The forward keeps each row's log-sum-exp; the backward
//! recomputes each probability from it (flash-attention 2's backward), so nothing of size
//! N x N is ever stored: one row of scores at a time in the forward, none in the backward.
//!
//! Per query row `n` and head `h` over its visible keys `j` (scores `s_j`, raw `r_j = scale ·
//! q·k_j`, `s_j = cap · tanh(r_j / cap)` with a cap, else `r_j`):
//! `p_j = exp(s_j − lse)`, `D = dout · out`, `ds_j = p_j (dout · v_j − D)`,
//! `dr_j = ds_j (1 − tanh²(r_j / cap))` (or `ds_j`), `dq += scale Σ dr_j k_j`,
//! `dk_j += scale · dr_j q`, `dv_j += p_j dout`.

use rayon::prelude::*;

use crate::train_op::{AttentionGrads, AttentionOut, SeqLayout, TrainAttention};
use crate::weight::dot;
use crate::{Error, Result, Tensor};

/// Checks q, k, v against the layout and the heads; returns (H, Hkv, Dh) (every backend's
/// check).
pub(crate) fn check(
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

/// The score of one query/key pair (after the optional soft cap) and the cap's slope there.
#[inline]
fn score(raw: f32, softcap: Option<f32>) -> (f32, f32) {
    match softcap {
        Some(cap) => {
            let t = (raw / cap).tanh();
            (cap * t, 1.0 - t * t)
        }
        None => (raw, 1.0),
    }
}

pub fn attention_train(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    layout: &SeqLayout,
    a: &TrainAttention,
) -> Result<AttentionOut> {
    let (h, hkv, dh) = check(q, k, v, layout, a)?;
    let n = layout.rows();
    let group = h / hkv;
    let (qw, kw) = (h * dh, hkv * dh);
    let (qd, kd, vd) = (q.data(), k.data(), v.data());
    let mut out = vec![0f32; n * qw];
    let mut lse = vec![0f32; n * h];
    out.par_chunks_mut(dh)
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each(|(idx, (o, l))| {
            let (row, hi) = (idx / h, idx % h);
            let kvh = hi / group;
            let (lo, hi_key) = layout.visible(row, a.p.window);
            let qv = &qd[row * qw + hi * dh..row * qw + (hi + 1) * dh];
            let scores: Vec<f32> = (lo..hi_key)
                .map(|j| {
                    let kr = &kd[j * kw + kvh * dh..j * kw + (kvh + 1) * dh];
                    score(dot(qv, kr) * a.p.scale, a.softcap).0
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            o.fill(0.0);
            for (s, j) in scores.iter().zip(lo..hi_key) {
                let e = (s - m).exp();
                sum += e;
                let vr = &vd[j * kw + kvh * dh..j * kw + (kvh + 1) * dh];
                for (ov, vv) in o.iter_mut().zip(vr) {
                    *ov += e * vv;
                }
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|x| *x *= inv);
            *l = m + sum.ln();
        });
    Ok(AttentionOut {
        out: Tensor::new(&[n, qw], out)?,
        lse: Tensor::new(&[n, h], lse)?,
    })
}

/// One (sequence, kv head) task's gradients: dq of its heads `(T, group, Dh)`, dk and dv
/// `(T, Dh)`, for the sequence's T rows.
struct TaskGrads {
    seq: usize,
    kvh: usize,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    fwd: &AttentionOut,
    dout: &Tensor,
    layout: &SeqLayout,
    a: &TrainAttention,
) -> Result<AttentionGrads> {
    let (h, hkv, dh) = check(q, k, v, layout, a)?;
    layout.check(dout, "attention dout")?;
    if dout.shape() != fwd.out.shape() || fwd.lse.dims2() != (layout.rows(), h) {
        return Err(Error::Shape(format!(
            "attention backward: dout {:?}, out {:?}, lse {:?}",
            dout.shape(),
            fwd.out.shape(),
            fwd.lse.shape()
        )));
    }
    let n = layout.rows();
    let group = h / hkv;
    let (qw, kw) = (h * dh, hkv * dh);
    let (qd, kd, vd) = (q.data(), k.data(), v.data());
    let (od, ld, gd) = (fwd.out.data(), fwd.lse.data(), dout.data());
    let scale = a.p.scale;
    let starts = layout.starts();
    let tasks: Vec<(usize, usize)> = (0..layout.sequences())
        .flat_map(|s| (0..hkv).map(move |g| (s, g)))
        .collect();
    let parts: Vec<TaskGrads> = tasks
        .par_iter()
        .map(|&(seq, kvh)| {
            let (a0, a1) = (starts[seq], starts[seq + 1]);
            let t = a1 - a0;
            let mut dq = vec![0f32; t * group * dh];
            let mut dk = vec![0f32; t * dh];
            let mut dv = vec![0f32; t * dh];
            for row in a0..a1 {
                let (lo, hi_key) = layout.visible(row, a.p.window);
                for gi in 0..group {
                    let head = kvh * group + gi;
                    let qo = row * qw + head * dh;
                    let qv = &qd[qo..qo + dh];
                    let go = &gd[qo..qo + dh];
                    let big_d = dot(go, &od[qo..qo + dh]);
                    let l = ld[row * h + head];
                    let dqr = &mut dq[((row - a0) * group + gi) * dh..][..dh];
                    for j in lo..hi_key {
                        let ko = j * kw + kvh * dh;
                        let kr = &kd[ko..ko + dh];
                        let vr = &vd[ko..ko + dh];
                        let (s, slope) = score(dot(qv, kr) * scale, a.softcap);
                        let p = (s - l).exp();
                        let jl = (j - a0) * dh;
                        for (dvv, gv) in dv[jl..jl + dh].iter_mut().zip(go) {
                            *dvv += p * gv;
                        }
                        let dr = p * (dot(go, vr) - big_d) * slope * scale;
                        for (d, kv) in dqr.iter_mut().zip(kr) {
                            *d += dr * kv;
                        }
                        for (d, qq) in dk[jl..jl + dh].iter_mut().zip(qv) {
                            *d += dr * qq;
                        }
                    }
                }
            }
            TaskGrads {
                seq,
                kvh,
                dq,
                dk,
                dv,
            }
        })
        .collect();
    let mut dq = vec![0f32; n * qw];
    let mut dk = vec![0f32; n * kw];
    let mut dv = vec![0f32; n * kw];
    for p in parts {
        let a0 = starts[p.seq];
        let t = starts[p.seq + 1] - a0;
        for r in 0..t {
            let row = a0 + r;
            let src = &p.dq[r * group * dh..(r + 1) * group * dh];
            let dst = row * qw + p.kvh * group * dh;
            dq[dst..dst + group * dh].copy_from_slice(src);
            let ko = row * kw + p.kvh * dh;
            dk[ko..ko + dh].copy_from_slice(&p.dk[r * dh..(r + 1) * dh]);
            dv[ko..ko + dh].copy_from_slice(&p.dv[r * dh..(r + 1) * dh]);
        }
    }
    Ok(AttentionGrads {
        dq: Tensor::new(&[n, qw], dq)?,
        dk: Tensor::new(&[n, kw], dk)?,
        dv: Tensor::new(&[n, kw], dv)?,
    })
}
