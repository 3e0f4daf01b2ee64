//! Attention of a training forward over a packed batch, and its backward, on the CPU: causal
//! within each sequence of the [`SeqLayout`], grouped KV heads, an optional sliding window and
//! an optional soft cap of the scores. The forward keeps each row's log-sum-exp; the backward
//! recomputes the probabilities from it tile by tile (flash-attention 2's backward), so nothing
//! of size T x T is ever stored: a tile of about 64 query rows (the tokens of a tile times the
//! heads sharing one kv head) against its visible keys at a time, its products on the `gemm`
//! crate's kernels. Work is split over (sequence, kv head) pairs.
//!
//! Per query row `n` and head `h` over its visible keys `j` (scores `s_j`, raw `r_j = scale ·
//! q·k_j`, `s_j = cap · tanh(r_j / cap)` with a cap, else `r_j`):
//! `p_j = exp(s_j − lse)`, `D = dout · out`, `ds_j = p_j (dout · v_j − D)`,
//! `dr_j = ds_j (1 − tanh²(r_j / cap))` (or `ds_j`), `dq += scale Σ dr_j k_j`,
//! `dk_j += scale · dr_j q`, `dv_j += p_j dout`.

use rayon::prelude::*;

use crate::dense::gemm_f32_serial;
use hf2q_tensor::train_op::{
    check_attention as check, AttentionGrads, AttentionOut, SeqLayout, TrainAttention,
};
use hf2q_tensor::{Error, Result, Tensor};

/// Query rows (tokens x heads of a kv group) per tile.
const TILE_ROWS: usize = 64;

/// The geometry of one (sequence, kv head) task.
struct Task<'a> {
    layout: &'a SeqLayout,
    a: &'a TrainAttention,
    /// First row and rows of the sequence.
    a0: usize,
    t: usize,
    kvh: usize,
    group: usize,
    dh: usize,
    /// Row widths of q and of k/v.
    qw: usize,
    kw: usize,
}

impl Task<'_> {
    /// Tokens per tile.
    fn tile_tokens(&self) -> usize {
        (TILE_ROWS / self.group).max(1)
    }
    /// `(T, Dh)` of kv head `kvh` of this sequence, from `x (N, Hkv*Dh)`.
    fn gather_kv(&self, x: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.t * self.dh);
        for r in self.a0..self.a0 + self.t {
            let o = r * self.kw + self.kvh * self.dh;
            out.extend_from_slice(&x[o..o + self.dh]);
        }
        out
    }
    /// `(tokens * group, Dh)` rows of the group's heads for tokens `t0..t1` (token-major), from
    /// `x (N, H*Dh)`.
    fn gather_q(&self, x: &[f32], t0: usize, t1: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity((t1 - t0) * self.group * self.dh);
        for t in t0..t1 {
            let o = (self.a0 + t) * self.qw + self.kvh * self.group * self.dh;
            out.extend_from_slice(&x[o..o + self.group * self.dh]);
        }
        out
    }
    /// Visible keys of tokens `t0..t1` as one range `lo..t1` (sequence-relative), and each
    /// token's own lower bound.
    fn key_range(&self, t0: usize, t1: usize) -> (usize, Vec<usize>) {
        let lows: Vec<usize> = (t0..t1)
            .map(|t| self.layout.visible(self.a0 + t, self.a.p.window).0 - self.a0)
            .collect();
        (lows[0], lows)
    }
    /// The scores of a tile, `(rows, L)` for keys `lo..t1`: scaled, soft-capped, masked to
    /// -inf outside each row's visible keys; and the cap's slope per element.
    fn scores(
        &self,
        q: &[f32],
        k: &[f32],
        t0: usize,
        t1: usize,
    ) -> Result<(Vec<f32>, Vec<f32>, usize)> {
        let (lo, lows) = self.key_range(t0, t1);
        let l = t1 - lo;
        let rows = (t1 - t0) * self.group;
        let mut s = vec![0f32; rows * l];
        gemm_f32_serial(
            &mut s,
            false,
            q,
            &k[lo * self.dh..t1 * self.dh],
            (rows, self.dh, l),
            false,
            true,
            self.a.p.scale,
        )?;
        let mut slope = vec![
            1f32;
            if self.a.softcap.is_some() {
                rows * l
            } else {
                0
            }
        ];
        for (ri, row) in s.chunks_mut(l).enumerate() {
            let t = t0 + ri / self.group;
            let vis = (lows[ri / self.group] - lo)..(t + 1 - lo);
            for (j, v) in row.iter_mut().enumerate() {
                if !vis.contains(&j) {
                    *v = f32::NEG_INFINITY;
                } else if let Some(cap) = self.a.softcap {
                    let th = (*v / cap).tanh();
                    *v = cap * th;
                    slope[ri * l + j] = 1.0 - th * th;
                }
            }
        }
        Ok((s, slope, lo))
    }
}

fn tasks(layout: &SeqLayout, hkv: usize) -> Vec<(usize, usize)> {
    (0..layout.sequences())
        .flat_map(|s| (0..hkv).map(move |g| (s, g)))
        .collect()
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
    let starts = layout.starts();
    // Per task: (seq, kvh, out rows (T, group, Dh), lse (T, group)).
    let parts: Vec<(usize, usize, Vec<f32>, Vec<f32>)> = tasks(layout, hkv)
        .par_iter()
        .map(|&(seq, kvh)| -> Result<_> {
            let task = Task {
                layout,
                a,
                a0: starts[seq],
                t: starts[seq + 1] - starts[seq],
                kvh,
                group,
                dh,
                qw,
                kw,
            };
            let (kg, vg) = (task.gather_kv(k.data()), task.gather_kv(v.data()));
            let mut out = vec![0f32; task.t * group * dh];
            let mut lse = vec![0f32; task.t * group];
            let step = task.tile_tokens();
            for t0 in (0..task.t).step_by(step) {
                let t1 = (t0 + step).min(task.t);
                let qt = task.gather_q(q.data(), t0, t1);
                let (mut s, _, lo) = task.scores(&qt, &kg, t0, t1)?;
                let l = t1 - lo;
                for (ri, row) in s.chunks_mut(l).enumerate() {
                    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for x in row.iter_mut() {
                        *x = (*x - m).exp();
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    row.iter_mut().for_each(|x| *x *= inv);
                    lse[t0 * group + ri] = m + sum.ln();
                }
                let rows = (t1 - t0) * group;
                gemm_f32_serial(
                    &mut out[t0 * group * dh..t1 * group * dh],
                    false,
                    &s,
                    &vg[lo * dh..t1 * dh],
                    (rows, l, dh),
                    false,
                    false,
                    1.0,
                )?;
            }
            Ok((seq, kvh, out, lse))
        })
        .collect::<Result<_>>()?;
    let mut out = vec![0f32; n * qw];
    let mut lse = vec![0f32; n * h];
    for (seq, kvh, o, l) in parts {
        for r in 0..starts[seq + 1] - starts[seq] {
            let row = starts[seq] + r;
            let dst = row * qw + kvh * group * dh;
            out[dst..dst + group * dh].copy_from_slice(&o[r * group * dh..(r + 1) * group * dh]);
            let ld = row * h + kvh * group;
            lse[ld..ld + group].copy_from_slice(&l[r * group..(r + 1) * group]);
        }
    }
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
    let starts = layout.starts();
    let parts: Vec<TaskGrads> = tasks(layout, hkv)
        .par_iter()
        .map(|&(seq, kvh)| -> Result<TaskGrads> {
            let task = Task {
                layout,
                a,
                a0: starts[seq],
                t: starts[seq + 1] - starts[seq],
                kvh,
                group,
                dh,
                qw,
                kw,
            };
            let (kg, vg) = (task.gather_kv(k.data()), task.gather_kv(v.data()));
            let mut dq = vec![0f32; task.t * group * dh];
            let mut dk = vec![0f32; task.t * dh];
            let mut dv = vec![0f32; task.t * dh];
            let step = task.tile_tokens();
            for t0 in (0..task.t).step_by(step) {
                let t1 = (t0 + step).min(task.t);
                let rows = (t1 - t0) * group;
                let qt = task.gather_q(q.data(), t0, t1);
                let got = task.gather_q(dout.data(), t0, t1);
                let ot = task.gather_q(fwd.out.data(), t0, t1);
                let (mut p, slope, lo) = task.scores(&qt, &kg, t0, t1)?;
                let l = t1 - lo;
                // P = exp(S - lse), row by row.
                for (ri, row) in p.chunks_mut(l).enumerate() {
                    let t = t0 + ri / group;
                    let lse = fwd.lse.data()[(task.a0 + t) * h + kvh * group + ri % group];
                    row.iter_mut().for_each(|x| *x = (*x - lse).exp());
                }
                // dV[lo..t1] += Pᵀ dO.
                gemm_f32_serial(
                    &mut dv[lo * dh..t1 * dh],
                    true,
                    &p,
                    &got,
                    (l, rows, dh),
                    true,
                    false,
                    1.0,
                )?;
                // dP = dO Vᵀ, then dS = P (dP - D) (times the cap's slope, and the scale).
                let mut ds = vec![0f32; rows * l];
                gemm_f32_serial(
                    &mut ds,
                    false,
                    &got,
                    &vg[lo * dh..t1 * dh],
                    (rows, dh, l),
                    false,
                    true,
                    1.0,
                )?;
                for ri in 0..rows {
                    let big_d: f32 = got[ri * dh..(ri + 1) * dh]
                        .iter()
                        .zip(&ot[ri * dh..(ri + 1) * dh])
                        .map(|(x, y)| x * y)
                        .sum();
                    for j in 0..l {
                        let e = ri * l + j;
                        let sl = if slope.is_empty() { 1.0 } else { slope[e] };
                        ds[e] = p[e] * (ds[e] - big_d) * sl * a.p.scale;
                    }
                }
                // dQ = dS K, dK[lo..t1] += dSᵀ Q.
                gemm_f32_serial(
                    &mut dq[t0 * group * dh..t1 * group * dh],
                    false,
                    &ds,
                    &kg[lo * dh..t1 * dh],
                    (rows, l, dh),
                    false,
                    false,
                    1.0,
                )?;
                gemm_f32_serial(
                    &mut dk[lo * dh..t1 * dh],
                    true,
                    &ds,
                    &qt,
                    (l, rows, dh),
                    true,
                    false,
                    1.0,
                )?;
            }
            Ok(TaskGrads {
                seq,
                kvh,
                dq,
                dk,
                dv,
            })
        })
        .collect::<Result<_>>()?;
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
