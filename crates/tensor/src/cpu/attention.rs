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

/// `silu(g) * u` elementwise (`silu(g) = g / (1 + e^-g)`), with [`exp_fast`] of `-|g|` only
/// (no overflow for any g): the fast paths' `silu_mul`. Relative error about 1e-6 + |g| * 1e-7
/// against `cpu::silu` (below g = -87, where silu is under 1e-35, it gives g * e^-87).
pub(crate) fn silu_mul(g: &[f32], u: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; g.len()];
    let run = |g: &[f32], u: &[f32], o: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        {
            use super::kernels::Isa;
            if Isa::best() == Isa::Avx512Vnni {
                // SAFETY: the CPU has AVX-512 F (checked by `Isa::best`).
                return unsafe { silu_mul_avx512(g, u, o) };
            }
            if Isa::best() == Isa::Avx2 {
                // SAFETY: the CPU has AVX2 and FMA (checked by `Isa::best`).
                return unsafe { silu_mul_avx2(g, u, o) };
            }
        }
        silu_mul_rows(g, u, o)
    };
    const CHUNK: usize = 1 << 14;
    if g.len() >= 4 * CHUNK {
        out.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
            .for_each(|(o, (g, u))| run(g, u, o));
    } else {
        run(g, u, &mut out);
    }
    out
}

#[inline(always)]
fn silu_mul_rows(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        let e = exp_fast(-g.abs());
        // sigmoid(g) from e^-|g| <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below.
        let s = if g >= 0.0 { 1.0 } else { e } / (1.0 + e);
        *o = g * s * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], out: &mut [f32]) {
    silu_mul_rows(g, u, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], out: &mut [f32]) {
    silu_mul_rows(g, u, out)
}

/// `s[j] = Σ_d q[d] * Kᵀ[d][a + j]` for the `s.len()` keys from `a`. A full block keeps its
/// scores in registers across the `d` loop, in two sums (even and odd `d`) so that the
/// multiply-adds are not one chain of their latency.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn scores(q: &[f32], kt: &[f32], s_all: usize, a: usize, s: &mut [f32]) {
    if s.len() == KB {
        let (mut l0, mut l1) = ([0f32; KB], [0f32; KB]);
        let dh = q.len();
        let mut d = 0;
        while d + 2 <= dh {
            let k0: &[f32; KB] = kt[d * s_all + a..d * s_all + a + KB]
                .try_into()
                .expect("a block of KB keys");
            let k1: &[f32; KB] = kt[(d + 1) * s_all + a..(d + 1) * s_all + a + KB]
                .try_into()
                .expect("a block of KB keys");
            let (q0, q1) = (q[d], q[d + 1]);
            for u in 0..KB {
                l0[u] = q0.mul_add(k0[u], l0[u]);
                l1[u] = q1.mul_add(k1[u], l1[u]);
            }
            d += 2;
        }
        if d < dh {
            let k: &[f32; KB] = kt[d * s_all + a..d * s_all + a + KB]
                .try_into()
                .expect("a block of KB keys");
            for u in 0..KB {
                l0[u] = q[d].mul_add(k[u], l0[u]);
            }
        }
        for u in 0..KB {
            s[u] = l0[u] + l1[u];
        }
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

/// The largest of 32 values, by halving (each step vectorises).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn max32(v: &[f32; KB]) -> f32 {
    let mut h = [0f32; 16];
    for u in 0..16 {
        h[u] = v[u].max(v[u + 16]);
    }
    let mut q = [0f32; 8];
    for u in 0..8 {
        q[u] = h[u].max(h[u + 8]);
    }
    let (a, b) = (
        q[0].max(q[4]).max(q[1].max(q[5])),
        q[2].max(q[6]).max(q[3].max(q[7])),
    );
    a.max(b)
}

/// The sum of 32 values, by halving (each step vectorises).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn sum32(v: &[f32; KB]) -> f32 {
    let mut h = [0f32; 16];
    for u in 0..16 {
        h[u] = v[u] + v[u + 16];
    }
    let mut q = [0f32; 8];
    for u in 0..8 {
        q[u] = h[u] + h[u + 8];
    }
    (q[0] + q[4]) + (q[1] + q[5]) + ((q[2] + q[6]) + (q[3] + q[7]))
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

/// One kv head's keys (transposed, `(Dh, S)` in rows `s_all >= S` apart) and values (`(S, Dh)`
/// rows from position 0).
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
    if t == 1 {
        return decode(q, cache, pos0, p);
    }
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    let width = h * dh;
    let total = pos0 + t;
    let group = h / hkv;
    let qd = q.data();
    // Kᵀ of each kv head over the keys any row of this call sees: (Dh, S) with S = pos0 + T,
    // rows `s_all` apart: S rounded up to 16 and each row 64-byte aligned, so that the vector
    // loads of a block of keys do not straddle cache lines.
    let s_all = total.div_ceil(16) * 16;
    let kts: Vec<(Vec<f32>, usize)> = (0..hkv)
        .into_par_iter()
        .map(|g| {
            let kbase = g * cache.capacity * dh;
            let mut buf = vec![0f32; dh * s_all + 16];
            let off = buf.as_ptr().align_offset(64).min(16);
            let kt = &mut buf[off..off + dh * s_all];
            for j in 0..total {
                let krow = &cache.k[kbase + j * dh..kbase + (j + 1) * dh];
                for (d, &kv) in krow.iter().enumerate() {
                    kt[d * s_all + j] = kv;
                }
            }
            (buf, off)
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
                    kt: &kts[g].0[kts[g].1..kts[g].1 + dh * s_all],
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

thread_local! {
    /// Scores of one decode head (grows to the longest context seen, then is reused).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Attention of one token (decode): each query head reads its kv head's key rows directly
/// (two passes: scores, then the weighted sum of values). The tiled path would transpose every
/// visible key of every kv head for this one row, which cost more than the attention itself.
/// Already checked by the caller: `q` is one row, the cache holds `pos0 + 1` positions.
fn decode(q: &Tensor, cache: &LayerCache<'_>, pos0: usize, p: &AttentionParams) -> Result<Tensor> {
    let (h, dh) = (p.n_heads, p.head_dim);
    let group = h / p.n_kv_heads;
    let lo = match p.window {
        Some(w) => (pos0 + 1).saturating_sub(w),
        None => 0,
    };
    let mut out = vec![0f32; h * dh];
    let run = |hi: usize, o: &mut [f32]| {
        let base = (hi / group) * cache.capacity * dh;
        let keys = &cache.k[base + lo * dh..base + (pos0 + 1) * dh];
        let vals = &cache.v[base + lo * dh..base + (pos0 + 1) * dh];
        let qh = &q.data()[hi * dh..(hi + 1) * dh];
        let mut with = |s: &mut Vec<f32>| decode_dispatch(qh, keys, vals, p.scale, s, o);
        SCORES.with(|c| match c.try_borrow_mut() {
            Ok(mut s) => with(&mut s),
            Err(_) => with(&mut Vec::new()),
        });
    };
    // A head is about 4 * S * Dh flops: hand heads to other threads only when that outweighs
    // waking them.
    if rayon::current_num_threads() > 1 && h * (pos0 + 1 - lo) * dh >= 1 << 16 {
        out.par_chunks_mut(dh)
            .enumerate()
            .for_each(|(hi, o)| run(hi, o));
    } else {
        out.chunks_mut(dh)
            .enumerate()
            .for_each(|(hi, o)| run(hi, o));
    }
    Tensor::new(&[1, h * dh], out)
}

/// [`decode_head`] compiled for the best vector unit this CPU has.
fn decode_dispatch(q: &[f32], k: &[f32], v: &[f32], scale: f32, s: &mut Vec<f32>, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::kernels::Isa;
        if Isa::best() == Isa::Avx512Vnni {
            // SAFETY: the CPU has AVX-512 F (checked by `Isa::best`).
            return unsafe { decode_avx512(q, k, v, scale, s, o) };
        }
        if Isa::best() == Isa::Avx2 {
            // SAFETY: the CPU has AVX2 and FMA (checked by `Isa::best`).
            return unsafe { decode_avx2(q, k, v, scale, s, o) };
        }
    }
    decode_head::<false>(q, k, v, scale, s, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn decode_avx512(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    scale: f32,
    s: &mut Vec<f32>,
    o: &mut [f32],
) {
    decode_head::<true>(q, k, v, scale, s, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn decode_avx2(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    scale: f32,
    s: &mut Vec<f32>,
    o: &mut [f32],
) {
    decode_head::<false>(q, k, v, scale, s, o)
}

/// One query head `q (Dh)` over key and value rows `k`, `v` (n, Dh) -> `o (Dh)`: scores,
/// softmax (with [`exp_fast`]), weighted sum. `s` is scratch. `V512`: called from an AVX-512
/// function (the dot products use its vectors directly).
#[inline(always)]
fn decode_head<const V512: bool>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    scale: f32,
    s: &mut Vec<f32>,
    o: &mut [f32],
) {
    let dh = q.len();
    let n = k.len() / dh;
    if n == 0 {
        // No visible key (a zero-width window): the reference's empty sum.
        o.fill(0.0);
        return;
    }
    // Plain loops, no closures: a closure is compiled without the caller's target features,
    // and its `mul_add` would become a library call.
    s.clear();
    s.resize(n, 0.0);
    let mut m = f32::NEG_INFINITY;
    for (e, kr) in s.iter_mut().zip(k.chunks_exact(dh)) {
        #[cfg(target_arch = "x86_64")]
        if V512 {
            // SAFETY: V512 is only set by `decode_avx512`, which runs where AVX-512 F is.
            *e = unsafe { x512::dot(q, kr) } * scale;
            m = m.max(*e);
            continue;
        }
        *e = dot16(q, kr) * scale;
        m = m.max(*e);
    }
    let mut lanes = [0f32; 16];
    let mut chunks = s.chunks_exact_mut(16);
    for c in &mut chunks {
        for (u, e) in c.iter_mut().enumerate() {
            *e = exp_fast(*e - m);
            lanes[u] += *e;
        }
    }
    let mut l = sum16(&lanes);
    for e in chunks.into_remainder() {
        *e = exp_fast(*e - m);
        l += *e;
    }
    o.fill(0.0);
    accumulate(o, &s[..n], v);
    let inv = 1.0 / l;
    for x in o.iter_mut() {
        *x *= inv;
    }
}

/// `Σ a[i] * b[i]` in 16 interleaved partial sums (one vector of multiply-adds).
#[inline(always)]
fn dot16(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = x.mul_add(*y, tail);
    }
    for (x, y) in ca.zip(cb) {
        let x: &[f32; 16] = x.try_into().expect("a chunk of 16");
        let y: &[f32; 16] = y.try_into().expect("a chunk of 16");
        for u in 0..16 {
            lanes[u] = x[u].mul_add(y[u], lanes[u]);
        }
    }
    sum16(&lanes) + tail
}

/// The sum of 16 values, by halving.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn sum16(v: &[f32; 16]) -> f32 {
    let mut h = [0f32; 8];
    for u in 0..8 {
        h[u] = v[u] + v[u + 8];
    }
    (h[0] + h[4]) + (h[1] + h[5]) + ((h[2] + h[6]) + (h[3] + h[7]))
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
    tile_rows::<false>(qd, kv, pos0, p, g, r0, n, tile)
}

/// `tile_rows` compiled with the named target features (the same body, vectorised for them).
macro_rules! tile_for_isa {
    ($name:ident, $features:literal, $v512:literal) => {
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
            tile_rows::<$v512>(qd, kv, pos0, p, g, r0, n, tile)
        }
    };
}

tile_for_isa!(tile_avx512, "avx512f,avx512bw,avx512vl,avx2,fma", true);
tile_for_isa!(tile_avx2, "avx2,fma", false);

/// One tile: rows `r0..r0+n` of kv head `g` -> their outputs `(n, Dh)`. `V512`: called from
/// an AVX-512 function, so the score and softmax steps of a block may use [`x512`].
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn tile_rows<const V512: bool>(
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
            let sb: &mut [f32; KB] = (&mut tile.s[i * KB..(i + 1) * KB])
                .try_into()
                .expect("a block of KB scores");
            let ar = &mut acc[i * dh..(i + 1) * dh];
            #[cfg(target_arch = "x86_64")]
            if V512 {
                // SAFETY: V512 is only set by `tile_avx512`, which runs where AVX-512 F is.
                let mnew = unsafe {
                    if w == KB {
                        x512::scores_block(qrow[i], kv.kt, s_all, a, sb);
                    } else {
                        scores(qrow[i], kv.kt, s_all, a, &mut sb[..w]);
                    }
                    x512::softmax_block(sb, w, p.scale, m[i], &mut l[i])
                };
                if m[i] != f32::NEG_INFINITY && mnew > m[i] {
                    let c = exp_fast(m[i] - mnew);
                    ar.iter_mut().for_each(|v| *v *= c);
                }
                m[i] = mnew;
                accumulate(ar, &sb[..w], &kv.v[a * dh..b * dh]);
                continue;
            }
            scores(qrow[i], kv.kt, s_all, a, &mut sb[..w]);
            // Whole-block vector steps: lanes past w hold -inf scores and then zero weights.
            for u in 0..KB {
                sb[u] = if u < w {
                    sb[u] * p.scale
                } else {
                    f32::NEG_INFINITY
                };
            }
            let bmax = max32(sb);
            let mnew = m[i].max(bmax);
            if m[i] != f32::NEG_INFINITY && mnew > m[i] {
                let c = exp_fast(m[i] - mnew);
                l[i] *= c;
                ar.iter_mut().for_each(|v| *v *= c);
            }
            m[i] = mnew;
            for u in 0..KB {
                let e = exp_fast(sb[u] - mnew);
                sb[u] = if u < w { e } else { 0.0 };
            }
            l[i] += sum32(sb);
            let s = &sb[..w];
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

/// AVX-512 forms of a block's score and softmax steps (the portable loops above compile to
/// scalar code with the scores kept on the stack).
#[cfg(target_arch = "x86_64")]
mod x512 {
    use std::arch::x86_64::*;

    use super::KB;

    /// `Σ a[i] * b[i]` over the shorter length: 16 lanes of multiply-adds in two chains.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), s0);
            s1 = _mm512_fmadd_ps(
                _mm512_loadu_ps(pa.add(i + 16)),
                _mm512_loadu_ps(pb.add(i + 16)),
                s1,
            );
            i += 32;
        }
        if i < n {
            // The last 1..31 values under masks (no read past either slice).
            let m0 = (n - i).min(16);
            let k0: __mmask16 = ((1u32 << m0) - 1) as __mmask16;
            s0 = _mm512_fmadd_ps(
                _mm512_maskz_loadu_ps(k0, pa.add(i)),
                _mm512_maskz_loadu_ps(k0, pb.add(i)),
                s0,
            );
            if n - i > 16 {
                let k1: __mmask16 = ((1u32 << (n - i - 16)) - 1) as __mmask16;
                s1 = _mm512_fmadd_ps(
                    _mm512_maskz_loadu_ps(k1, pa.add(i + 16)),
                    _mm512_maskz_loadu_ps(k1, pb.add(i + 16)),
                    s1,
                );
            }
        }
        _mm512_reduce_add_ps(_mm512_add_ps(s0, s1))
    }

    /// [`super::scores`] for a whole block of `KB` keys from `a`: two sums of 32 lanes (even and
    /// odd `d`) so that the multiply-adds are not one chain of their latency.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_block(
        q: &[f32],
        kt: &[f32],
        s_all: usize,
        a: usize,
        s: &mut [f32; KB],
    ) {
        let dh = q.len();
        assert!(dh > 0 && (dh - 1) * s_all + a + KB <= kt.len());
        let k = kt.as_ptr().add(a);
        let (mut e0, mut e1, mut o0, mut o1) = (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
        let mut d = 0;
        while d + 2 <= dh {
            let (k0, k1) = (k.add(d * s_all), k.add((d + 1) * s_all));
            let (q0, q1) = (_mm512_set1_ps(q[d]), _mm512_set1_ps(q[d + 1]));
            e0 = _mm512_fmadd_ps(q0, _mm512_loadu_ps(k0), e0);
            e1 = _mm512_fmadd_ps(q0, _mm512_loadu_ps(k0.add(16)), e1);
            o0 = _mm512_fmadd_ps(q1, _mm512_loadu_ps(k1), o0);
            o1 = _mm512_fmadd_ps(q1, _mm512_loadu_ps(k1.add(16)), o1);
            d += 2;
        }
        if d < dh {
            let k0 = k.add(d * s_all);
            let q0 = _mm512_set1_ps(q[d]);
            e0 = _mm512_fmadd_ps(q0, _mm512_loadu_ps(k0), e0);
            e1 = _mm512_fmadd_ps(q0, _mm512_loadu_ps(k0.add(16)), e1);
        }
        _mm512_storeu_ps(s.as_mut_ptr(), _mm512_add_ps(e0, o0));
        _mm512_storeu_ps(s.as_mut_ptr().add(16), _mm512_add_ps(e1, o1));
    }

    /// `exp_fast` on 16 lanes (the same steps, the polynomial with fused multiply-adds).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp16(x: __m512) -> __m512 {
        const MAGIC: f32 = 12_582_912.0;
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let t = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E));
        let magic = _mm512_set1_ps(MAGIC);
        let r = _mm512_add_ps(t, magic);
        let n = _mm512_sub_epi32(_mm512_castps_si512(r), _mm512_castps_si512(magic));
        let f = _mm512_sub_ps(t, _mm512_sub_ps(r, magic));
        let c = |v: f32| _mm512_set1_ps(v);
        let mut p = c(0.000_154_035_3);
        p = _mm512_fmadd_ps(p, f, c(0.001_333_355));
        p = _mm512_fmadd_ps(p, f, c(0.009_618_129));
        p = _mm512_fmadd_ps(p, f, c(0.055_504_11));
        p = _mm512_fmadd_ps(p, f, c(0.240_226_5));
        p = _mm512_fmadd_ps(p, f, c(std::f32::consts::LN_2));
        p = _mm512_fmadd_ps(p, f, c(1.0));
        let pow2 = _mm512_slli_epi32::<23>(_mm512_add_epi32(n, _mm512_set1_epi32(127)));
        _mm512_mul_ps(_mm512_castsi512_ps(pow2), p)
    }

    /// A block's online-softmax step: scales the `w` scores in `s`, takes the new running max
    /// (returned) from `m_old`, rescales the running sum `l` if the max grew, and turns the
    /// scores into weights `exp(score - max)` (zero past `w`), adding them to `l`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax_block(
        s: &mut [f32; KB],
        w: usize,
        scale: f32,
        m_old: f32,
        l: &mut f32,
    ) -> f32 {
        let valid = if w >= KB { !0u32 } else { (1u32 << w) - 1 };
        let (k0, k1) = (valid as __mmask16, (valid >> 16) as __mmask16);
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let sc = _mm512_set1_ps(scale);
        let p = s.as_mut_ptr();
        let x0 = _mm512_mask_mul_ps(ninf, k0, _mm512_loadu_ps(p), sc);
        let x1 = _mm512_mask_mul_ps(ninf, k1, _mm512_loadu_ps(p.add(16)), sc);
        let bmax = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
        let mnew = m_old.max(bmax);
        if m_old != f32::NEG_INFINITY && mnew > m_old {
            *l *= super::exp_fast(m_old - mnew);
        }
        let mv = _mm512_set1_ps(mnew);
        let e0 = _mm512_maskz_mov_ps(k0, exp16(_mm512_sub_ps(x0, mv)));
        let e1 = _mm512_maskz_mov_ps(k1, exp16(_mm512_sub_ps(x1, mv)));
        _mm512_storeu_ps(p, e0);
        _mm512_storeu_ps(p.add(16), e1);
        *l += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        mnew
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "x86_64")]
    use super::decode_avx512;
    use super::decode_head;
    use super::exp_fast;

    #[test]
    fn silu_mul_matches_the_reference() {
        let g: Vec<f32> = (0..100_000)
            .map(|i| ((i * 7919) % 20011) as f32 / 20011.0 * 200.0 - 100.0)
            .chain([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 1e4, -1e4])
            .collect();
        let u: Vec<f32> = (0..g.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let got = super::silu_mul(&g, &u);
        for ((&g, &u), &y) in g.iter().zip(&u).zip(&got) {
            let want = crate::cpu::silu(g) * u;
            assert!(
                // exp_fast's error grows as |x| * 1e-7 (the rounding of x * log2 e), and below
                // g = -87 it stops at e^-87: outputs under 1e-33 instead of 0.
                (y - want).abs() <= (2e-6 + 1e-7 * g.abs()) * want.abs() + 1e-30 * u.abs(),
                "silu({g}) * {u}: {y} vs {want}"
            );
        }
    }

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

    /// The decode head (portable and AVX-512 forms) against a plain f64 softmax-weighted sum,
    /// for head widths with and without a partial 16/32-lane tail and contexts of 1..=40 keys.
    /// Allowed: 1e-5 relative to Σ p |v| (the f32 sums and `exp_fast`'s 5e-7 relative error).
    #[test]
    fn decode_head_matches_f64() {
        let mut seed = 0x1234_5678_9abc_def1u64;
        let mut f = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        };
        let mut s = Vec::new();
        // No visible key: zeros, as the reference's empty sum.
        let mut o = vec![f32::NAN; 8];
        decode_head::<false>(&[1.0; 8], &[], &[], 1.0, &mut s, &mut o);
        assert_eq!(o, [0.0; 8]);
        for dh in [8, 16, 40, 64, 100] {
            for n in [1, 2, 17, 40] {
                let q: Vec<f32> = (0..dh).map(|_| 2.0 * f()).collect();
                let k: Vec<f32> = (0..n * dh).map(|_| 2.0 * f()).collect();
                let v: Vec<f32> = (0..n * dh).map(|_| f()).collect();
                let scale = 1.0 / (dh as f32).sqrt();
                let sc: Vec<f64> = k
                    .chunks(dh)
                    .map(|kr| {
                        q.iter()
                            .zip(kr)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = p.iter().sum();
                let mut forms: Vec<(&str, Vec<f32>)> = Vec::new();
                let mut o = vec![f32::NAN; dh];
                decode_head::<false>(&q, &k, &v, scale, &mut s, &mut o);
                forms.push(("portable", o.clone()));
                #[cfg(target_arch = "x86_64")]
                if super::super::kernels::Isa::Avx512Vnni.is_available() {
                    // SAFETY: AVX-512 F checked just above.
                    unsafe { decode_avx512(&q, &k, &v, scale, &mut s, &mut o) };
                    forms.push(("avx512", o.clone()));
                }
                for (name, o) in forms {
                    for c in 0..dh {
                        let want: f64 =
                            (0..n).map(|j| p[j] / l * v[j * dh + c] as f64).sum::<f64>();
                        let mag: f64 = (0..n)
                            .map(|j| p[j] / l * (v[j * dh + c] as f64).abs())
                            .sum::<f64>();
                        assert!(
                            (o[c] as f64 - want).abs() <= 1e-5 * mag + 1e-30,
                            "{name} dh={dh} n={n} c={c}: {} vs {want}",
                            o[c]
                        );
                    }
                }
            }
        }
    }
}
