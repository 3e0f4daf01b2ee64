//! Fast causal attention on the CPU (the `Fast` paths): flash-attention style, tiled so that
//! memory stays linear in the context and every key and value row is loaded once per tile of
//! query rows, with no horizontal sums in the inner loops.
//!
//! For one KV head: its visible keys are transposed once per call into `Kᵀ (Dh, S)`; the query rows
//! that read the head (each token of the call times each query head of the group) are taken `QT`
//! at a time, and keys are walked in blocks of `KB`:
//! - the scores of a query row over a block are `Σ_d q[d] * Kᵀ[d][j0..j0+KB]`: broadcast
//!   multiply-adds over `KB` keys at once, only over the row's visible (contiguous) keys;
//! - online softmax: a running max `m` and sum `l` per row; when the max grows, the row's
//!   accumulator and sum are rescaled by `exp(m_old - m_new)`;
//! - `acc[row] += p[j] * V[j]` over the block.
//!
//! `exp` is a polynomial (relative error under 5e-7 for the weights that matter, plus the f32
//! rounding of `x * log2 e`, about |x| * 1e-7: far below the rounding of the sums it feeds).
//! The scalar reference (`CpuBackend::attention` on the reference path) is what this is tested
//! against (`tests/attention_fast.rs`).

use rayon::prelude::*;

use crate::op::{AttentionParams, LayerCache};
use crate::{Result, Tensor};

/// Query rows per tile.
const QT: usize = 8;
/// Keys per block.
const KB: usize = 32;

/// `e^x` for `x <= 0` (and moderately positive x), vectorisable: `2^(x log2 e)` split into an
/// integer power of two and a degree-6 polynomial on [-0.5, 0.5].
#[inline(always)]
fn exp_fast(x: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to the nearest integer, which lands in the low mantissa
    // bits (no float-to-int conversion, so the loop vectorises); valid for |t| < 2^22.
    const MAGIC: f32 = 12_582_912.0;
    let x = x.max(-87.0);
    let t = x * std::f32::consts::LOG2_E;
    let r = t + MAGIC;
    let n = r.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let f = t - (r - MAGIC);
    // 2^f on [-0.5, 0.5] (Taylor coefficients of e^(f ln 2)).
    let p = 1.0
        + f * (std::f32::consts::LN_2
            + f * (0.240_226_5
                + f * (0.055_504_11
                    + f * (0.009_618_129 + f * (0.001_333_355 + f * 0.000_154_035_3)))));
    f32::from_bits(((n + 127) as u32) << 23) * p
}

/// `s[j] = Σ_d q[d] * Kᵀ[d][a + j]` for the `s.len()` keys from `a`. A full block keeps its
/// scores in registers across the `d` loop.
#[inline(always)]
fn scores(q: &[f32], kt: &[f32], s_all: usize, a: usize, s: &mut [f32]) {
    if s.len() == KB {
        let mut loc = [0f32; KB];
        for (d, &qv) in q.iter().enumerate() {
            let k: &[f32; KB] = kt[d * s_all + a..d * s_all + a + KB]
                .try_into()
                .expect("a block of KB keys");
            for u in 0..KB {
                loc[u] = qv.mul_add(k[u], loc[u]);
            }
        }
        s.copy_from_slice(&loc);
        return;
    }
    s.iter_mut().for_each(|v| *v = 0.0);
    for (d, &qv) in q.iter().enumerate() {
        let k = &kt[d * s_all + a..d * s_all + a + s.len()];
        for (sv, &kk) in s.iter_mut().zip(k) {
            *sv = qv.mul_add(kk, *sv);
        }
    }
}

/// `acc += Σ_j p[j] * v[j]` over value rows `v (p.len(), Dh)`; 64 columns at a time stay in
/// registers across the rows.
#[inline(always)]
fn accumulate(acc: &mut [f32], p: &[f32], v: &[f32]) {
    const CH: usize = 64;
    let dh = acc.len();
    let mut c = 0;
    while c + CH <= dh {
        let mut loc: [f32; CH] = acc[c..c + CH].try_into().expect("a chunk");
        for (j, &pj) in p.iter().enumerate() {
            let vr: &[f32; CH] = v[j * dh + c..j * dh + c + CH].try_into().expect("a chunk");
            for u in 0..CH {
                loc[u] = pj.mul_add(vr[u], loc[u]);
            }
        }
        acc[c..c + CH].copy_from_slice(&loc);
        c += CH;
    }
    if c < dh {
        for (j, &pj) in p.iter().enumerate() {
            let vr = &v[j * dh + c..(j + 1) * dh];
            for (av, &vv) in acc[c..].iter_mut().zip(vr) {
                *av = pj.mul_add(vv, *av);
            }
        }
    }
}

/// One kv head's keys (transposed, `(Dh, s_all)`) and values (`(S, Dh)` rows from position 0).
struct Keys<'a> {
    kt: &'a [f32],
    s_all: usize,
    v: &'a [f32],
}

/// Scratch of one task.
struct Tile {
    s: Vec<f32>,
    acc: Vec<f32>,
}

/// Causal attention of `q (T, H*Dh)` at positions `pos0..pos0+T` over `cache` (see
/// `Backend::attend`), flash style (module header).
pub fn attention(
    q: &Tensor,
    cache: &LayerCache<'_>,
    pos0: usize,
    p: &AttentionParams,
) -> Result<Tensor> {
    let t = crate::op::check_attention(q, cache, pos0, p)?;
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    let width = h * dh;
    let total = pos0 + t;
    let group = h / hkv;
    let qd = q.data();
    // Kᵀ of each kv head over the keys any row of this call sees: (Dh, S) with S = pos0 + T.
    let s_all = total;
    let kts: Vec<Vec<f32>> = (0..hkv)
        .into_par_iter()
        .map(|g| {
            let kbase = g * cache.capacity * dh;
            let mut kt = vec![0f32; dh * s_all];
            for j in 0..s_all {
                let krow = &cache.k[kbase + j * dh..kbase + (j + 1) * dh];
                for (d, &kv) in krow.iter().enumerate() {
                    kt[d * s_all + j] = kv;
                }
            }
            kt
        })
        .collect();
    // Work items: (kv head, first row of a tile); rows of a kv head are (token, head in group)
    // in token order, so a tile spans few positions.
    let rows_per_head = t * group;
    let items: Vec<(usize, usize)> = (0..hkv)
        .flat_map(|g| (0..rows_per_head).step_by(QT).map(move |r| (g, r)))
        .collect();
    let results: Vec<(usize, usize, Vec<f32>)> = items
        .into_par_iter()
        .map_init(
            || Tile {
                s: vec![0f32; QT * KB],
                acc: vec![0f32; QT * dh],
            },
            |tile, (g, r0)| {
                let n = QT.min(rows_per_head - r0);
                let kv = Keys {
                    kt: &kts[g],
                    s_all,
                    v: &cache.v[g * cache.capacity * dh..],
                };
                let out = tile_dispatch(qd, &kv, pos0, p, g, r0, n, tile);
                (g, r0, out)
            },
        )
        .collect();
    let mut out = vec![0f32; t * width];
    for (g, r0, o) in results {
        for (i, orow) in o.chunks_exact(dh).enumerate() {
            let r = r0 + i;
            let (ti, hi) = (r / group, g * group + r % group);
            out[ti * width + hi * dh..ti * width + (hi + 1) * dh].copy_from_slice(orow);
        }
    }
    Tensor::new(&[t, width], out)
}

/// [`tile_rows`] compiled for the best vector unit this CPU has (the loops are written to
/// vectorise).
#[allow(clippy::too_many_arguments)]
fn tile_dispatch(
    qd: &[f32],
    kv: &Keys<'_>,
    pos0: usize,
    p: &AttentionParams,
    g: usize,
    r0: usize,
    n: usize,
    tile: &mut Tile,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        use super::kernels::Isa;
        if Isa::best() == Isa::Avx512Vnni {
            // SAFETY: the CPU has AVX-512 F (checked by `Isa::best`).
            return unsafe { tile_avx512(qd, kv, pos0, p, g, r0, n, tile) };
        }
        if Isa::best() == Isa::Avx2 {
            // SAFETY: the CPU has AVX2 and FMA (checked by `Isa::best`).
            return unsafe { tile_avx2(qd, kv, pos0, p, g, r0, n, tile) };
        }
    }
    tile_rows(qd, kv, pos0, p, g, r0, n, tile)
}

/// `tile_rows` compiled with the named target features (the same body, vectorised for them).
macro_rules! tile_for_isa {
    ($name:ident, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name(
            qd: &[f32],
            kv: &Keys<'_>,
            pos0: usize,
            p: &AttentionParams,
            g: usize,
            r0: usize,
            n: usize,
            tile: &mut Tile,
        ) -> Vec<f32> {
            tile_rows(qd, kv, pos0, p, g, r0, n, tile)
        }
    };
}

tile_for_isa!(tile_avx512, "avx512f,avx512bw,avx512vl,avx2,fma");
tile_for_isa!(tile_avx2, "avx2,fma");

/// One tile: rows `r0..r0+n` of kv head `g` -> their outputs `(n, Dh)`.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn tile_rows(
    qd: &[f32],
    kv: &Keys<'_>,
    pos0: usize,
    p: &AttentionParams,
    g: usize,
    r0: usize,
    n: usize,
    tile: &mut Tile,
) -> Vec<f32> {
    let (h, dh) = (p.n_heads, p.head_dim);
    let group = h / p.n_kv_heads;
    let width = h * dh;
    let s_all = kv.s_all;
    // Per row: its query, and visible key range [lo, hi].
    let mut qrow: [&[f32]; QT] = [&[]; QT];
    let mut range = [(0usize, 0usize); QT];
    for i in 0..n {
        let r = r0 + i;
        let (ti, hi) = (r / group, g * group + r % group);
        qrow[i] = &qd[ti * width + hi * dh..ti * width + (hi + 1) * dh];
        let qpos = pos0 + ti;
        let lo = match p.window {
            Some(w) => (qpos + 1).saturating_sub(w),
            None => 0,
        };
        range[i] = (lo, qpos);
    }
    let lo_all = range[..n].iter().map(|r| r.0).min().unwrap_or(0);
    let hi_all = range[..n].iter().map(|r| r.1).max().unwrap_or(0);
    let mut m = [f32::NEG_INFINITY; QT];
    let mut l = [0f32; QT];
    let acc = &mut tile.acc[..n * dh];
    acc.iter_mut().for_each(|v| *v = 0.0);
    let mut j0 = lo_all;
    while j0 <= hi_all {
        let kb = KB.min(hi_all + 1 - j0);
        for i in 0..n {
            // This row's visible keys inside the block: [a, b) (contiguous).
            let (lo, hi) = range[i];
            let a = lo.max(j0);
            let b = (hi + 1).min(j0 + kb);
            if a >= b {
                continue;
            }
            let w = b - a;
            let s = &mut tile.s[i * KB..i * KB + w];
            scores(qrow[i], kv.kt, s_all, a, s);
            let mut bmax = f32::NEG_INFINITY;
            for sv in s.iter_mut() {
                *sv *= p.scale;
                bmax = bmax.max(*sv);
            }
            let mnew = m[i].max(bmax);
            let ar = &mut acc[i * dh..(i + 1) * dh];
            if m[i] != f32::NEG_INFINITY && mnew > m[i] {
                let c = exp_fast(m[i] - mnew);
                l[i] *= c;
                ar.iter_mut().for_each(|v| *v *= c);
            }
            m[i] = mnew;
            let mut sum = 0f32;
            for sv in s.iter_mut() {
                let e = exp_fast(*sv - mnew);
                *sv = e;
                sum += e;
            }
            l[i] += sum;
            accumulate(ar, s, &kv.v[a * dh..b * dh]);
        }
        j0 += kb;
    }
    let mut out = vec![0f32; n * dh];
    for i in 0..n {
        let inv = if l[i] > 0.0 { 1.0 / l[i] } else { 0.0 };
        for (o, &a) in out[i * dh..(i + 1) * dh]
            .iter_mut()
            .zip(&acc[i * dh..(i + 1) * dh])
        {
            *o = a * inv;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::exp_fast;

    #[test]
    fn exp_is_accurate() {
        let mut x = -80.0f32;
        while x <= 10.0 {
            let (a, b) = (exp_fast(x), x.exp());
            // The polynomial and its f32 evaluation are good to 5e-7; rounding x * log2(e) adds
            // about |x| * 1e-7 (8e-6 at x = -80, where the weight is 1e-35 and negligible).
            let tol = 5e-7 + 1e-7 * x.abs();
            assert!(((a - b) / b).abs() < tol, "exp({x}) = {a}, want {b}");
            x += 0.0137;
        }
        assert_eq!(exp_fast(f32::NEG_INFINITY.max(-1e30)), exp_fast(-87.0));
    }
}
