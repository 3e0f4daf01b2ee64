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
//! against (`tests/attention_fast.rs`). One token (decode) is `decode.rs`, by kv head, reading
//! the cache through the same [`KvRead`].
//!
//! The cache holds f32 or f16 values ([`KvElem`]). Decode widens f16 rows to f32 where it reads
//! them, inside the dot products and weighted sums (hardware conversion on x86-64: F16C with
//! AVX2, `vcvtph2ps` on 512-bit vectors with AVX-512), never copying them out first. Prefill
//! already copies each kv head's keys (the transpose) and widens them there; it widens the
//! values once per call too, since every query row of the head reads them (a copy as large as
//! Kᵀ, for the call only). The arithmetic after the loads is the same for both types.
//!
//! A block cache (ggml's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and mlx-lm's affine groups of 32, 64 or
//! 128 values: [`KvBlock`]) stores a row as `Dh / 32` blocks of an f16 scale (and offset), and 32
//! small integers (an affine group: one scale and bias for its 32-value parts). Decode reads the blocks directly
//! ([`BlockRead`]): a key's score is `Σ_b (d_b · Σ_i q[32b+i] · x_b[i] + m_b · Σ_i q[32b+i])`
//! (the integers widened to f32 in registers, one scale multiply per block), and the weighted
//! sum adds `(p_j · d_b) · x_b[i]` (one product per block and key, then one multiply-add per
//! value; offsets summed apart); Q8_0 has hand-written AVX2 and AVX-512 forms, the others the
//! portable loops vectorised by the compiler. Prefill dequantizes into the per-call Kᵀ and
//! value copies the tiles read (as it widens f16),
//! one row at a time; nothing dequantizes the cache as a whole.

use half::f16;
use rayon::prelude::*;

use super::kernels::Isa;
use hf2q_tensor::kv::{
    BlockAffine, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, KvBlock, Q8_0_VALUES,
};
use hf2q_tensor::op::{AttentionParams, KvElem, KvScalar, LayerCache};
use hf2q_tensor::{Error, Result, Tensor};

/// The vector unit a kernel body is compiled for, a const parameter so that each form is
/// specialised: the portable loops (vectorised by the compiler for whatever the caller enables),
/// AVX2 + FMA + F16C, or AVX-512 F/BW/VL. A body is only instantiated with `AVX2` or `AVX512`
/// inside a function compiled with those features, which runs only where the CPU has them.
pub(crate) const PORTABLE: u8 = 0;
#[cfg(target_arch = "x86_64")]
pub(crate) const AVX2: u8 = 1;
#[cfg(target_arch = "x86_64")]
pub(crate) const AVX512: u8 = 2;

/// How the kernels read a cache row of one element type (the sealed part of [`KvElem`]). A row
/// of `Dh` values is `Dh / Self::VALUES` elements.
pub trait KvRead: KvElem + Sized {
    /// `Σ q[d] * k[d]` over a key row (`q.len()` values).
    fn dot<const L: u8>(q: &[f32], k: &[Self]) -> f32;
    /// `acc += Σ_j p[j] * v[j]` over value rows `v (p.len(), Dh)`, `Dh = acc.len()`.
    fn accumulate<const L: u8>(acc: &mut [f32], p: &[f32], v: &[Self]);
    /// The values themselves when they are f32.
    fn as_f32(v: &[Self]) -> Option<&[f32]>;
    /// `out = v` as f32 (`out.len() == v.len() * VALUES`).
    fn widen<const L: u8>(v: &[Self], out: &mut [f32]);
    /// The scores of query rows `q (G, Dh)` over key rows `k (n, Dh / VALUES)`:
    /// `s[r * n + j] = q_r · k_j` (`s (G, n)`). By default [`KvRead::dot`] per row and key; a
    /// type may read each key once for all `G` rows (decode's grouped kernels).
    #[inline(always)]
    fn scores<const L: u8>(q: &[f32], dh: usize, k: &[Self], s: &mut [f32]) {
        scores_by_row::<L, Self>(q, dh, k, s)
    }
    /// `acc (G, Dh) += p (G, n) · v (n, Dh / VALUES)`. By default [`KvRead::accumulate`] per
    /// row; a type may read each value row once for all `G` rows.
    #[inline(always)]
    fn accumulate_rows<const L: u8>(acc: &mut [f32], dh: usize, p: &[f32], v: &[Self]) {
        accumulate_by_row::<L, Self>(acc, dh, p, v)
    }
}

/// [`KvRead::scores`] a row and a key at a time.
#[inline(always)]
fn scores_by_row<const L: u8, T: KvRead>(q: &[f32], dh: usize, k: &[T], s: &mut [f32]) {
    let rw = dh / T::VALUES;
    let n = k.len() / rw;
    if n == 0 {
        return;
    }
    for (qr, sr) in q.chunks_exact(dh).zip(s.chunks_exact_mut(n)) {
        for (e, kr) in sr.iter_mut().zip(k.chunks_exact(rw)) {
            *e = T::dot::<L>(qr, kr);
        }
    }
}

/// [`KvRead::accumulate_rows`] a row at a time.
#[inline(always)]
fn accumulate_by_row<const L: u8, T: KvRead>(acc: &mut [f32], dh: usize, p: &[f32], v: &[T]) {
    let n = p.len() / (acc.len() / dh).max(1);
    if n == 0 {
        return;
    }
    for (ar, pr) in acc.chunks_exact_mut(dh).zip(p.chunks_exact(n)) {
        T::accumulate::<L>(ar, pr, v);
    }
}

impl KvRead for f32 {
    #[inline(always)]
    fn dot<const L: u8>(q: &[f32], k: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if L == AVX512 {
            // SAFETY: L is AVX512 only in bodies compiled for AVX-512 F (see `PORTABLE`).
            return unsafe { x512::dot(q, k) };
        }
        dot16(q, k)
    }
    #[inline(always)]
    fn accumulate<const L: u8>(acc: &mut [f32], p: &[f32], v: &[f32]) {
        // The portable loop vectorises well for f32 under the caller's features.
        accumulate(acc, p, v)
    }
    #[inline(always)]
    fn as_f32(v: &[f32]) -> Option<&[f32]> {
        Some(v)
    }
    #[inline(always)]
    fn widen<const L: u8>(v: &[f32], out: &mut [f32]) {
        out.copy_from_slice(v)
    }
}

impl KvRead for f16 {
    #[inline(always)]
    fn dot<const L: u8>(q: &[f32], k: &[f16]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: L names features the enclosing body was compiled for (see `PORTABLE`).
            if L == AVX512 {
                return unsafe { x512::dot_f16(q, k) };
            }
            if L == AVX2 {
                return unsafe { x256::dot_f16(q, k) };
            }
        }
        dot16(q, k)
    }
    #[inline(always)]
    fn accumulate<const L: u8>(acc: &mut [f32], p: &[f32], v: &[f16]) {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: L names features the enclosing body was compiled for (see `PORTABLE`).
            if L == AVX512 {
                return unsafe { x512::accumulate_f16(acc, p, v) };
            }
            if L == AVX2 {
                return unsafe { x256::accumulate_f16(acc, p, v) };
            }
        }
        accumulate(acc, p, v)
    }
    #[inline(always)]
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn widen<const L: u8>(v: &[f16], out: &mut [f32]) {
        assert_eq!(v.len(), out.len());
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: L names features the enclosing body was compiled for (see `PORTABLE`).
            if L == AVX512 {
                return unsafe { x512::widen_f16(v, out) };
            }
            if L == AVX2 {
                return unsafe { x256::widen_f16(v, out) };
            }
        }
        for (o, x) in out.iter_mut().zip(v) {
            *o = x.to_f32();
        }
    }
}

/// A ggml block type as the kernels read it ([`KvBlock`]): decode's dot products and weighted
/// sums read the blocks themselves (module header) through portable loops over whole blocks,
/// vectorised under the caller's features (the integers unpacked and widened to f32 in
/// registers); a type may give hand-written SIMD forms for a vector unit instead (Q8_0 does, for
/// AVX2 and AVX-512). Prefill widens rows with ggml's dequantizer.
pub trait BlockRead: KvBlock {
    /// [`KvRead::dot`] in this type's own SIMD form for the vector unit `L`, if it has one.
    #[inline(always)]
    fn dot_simd<const L: u8>(_q: &[f32], _k: &[Self]) -> Option<f32> {
        None
    }
    /// [`KvRead::accumulate`] in this type's own SIMD form for `L`; false if it has none.
    #[inline(always)]
    fn accumulate_simd<const L: u8>(_acc: &mut [f32], _p: &[f32], _v: &[Self]) -> bool {
        false
    }
    /// [`KvRead::scores`] in a grouped SIMD form for `L`; false if it has none.
    #[inline(always)]
    fn scores_simd<const L: u8>(_q: &[f32], _dh: usize, _k: &[Self], _s: &mut [f32]) -> bool {
        false
    }
    /// [`KvRead::accumulate_rows`] in a grouped SIMD form for `L`; false if it has none.
    #[inline(always)]
    fn accumulate_rows_simd<const L: u8>(
        _acc: &mut [f32],
        _dh: usize,
        _p: &[f32],
        _v: &[Self],
    ) -> bool {
        false
    }
}

impl<B: BlockRead> KvRead for B {
    #[inline(always)]
    fn dot<const L: u8>(q: &[f32], k: &[B]) -> f32 {
        match B::dot_simd::<L>(q, k) {
            Some(s) => s,
            None => dot_blocks(q, k),
        }
    }
    #[inline(always)]
    fn accumulate<const L: u8>(acc: &mut [f32], p: &[f32], v: &[B]) {
        if !B::accumulate_simd::<L>(acc, p, v) {
            accumulate_blocks(acc, p, v)
        }
    }
    #[inline(always)]
    fn as_f32(_: &[B]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn widen<const L: u8>(v: &[B], out: &mut [f32]) {
        B::dequantize_row(v, out)
    }
    #[inline(always)]
    fn scores<const L: u8>(q: &[f32], dh: usize, k: &[B], s: &mut [f32]) {
        if !B::scores_simd::<L>(q, dh, k, s) {
            scores_by_row::<L, B>(q, dh, k, s)
        }
    }
    #[inline(always)]
    fn accumulate_rows<const L: u8>(acc: &mut [f32], dh: usize, p: &[f32], v: &[B]) {
        if !B::accumulate_rows_simd::<L>(acc, dh, p, v) {
            accumulate_by_row::<L, B>(acc, dh, p, v)
        }
    }
}

/// The grouped decode kernels of the 8-bit block types (`decode::x512`, `decode::x256`), for
/// AVX-512 and AVX2.
macro_rules! int8_grouped {
    () => {
        #[inline(always)]
        fn scores_simd<const L: u8>(q: &[f32], dh: usize, k: &[Self], s: &mut [f32]) -> bool {
            #[cfg(target_arch = "x86_64")]
            if L == AVX512 {
                // SAFETY: L names features the enclosing body was compiled for (AVX-512 F,
                // FMA, F16C: see `PORTABLE`).
                unsafe { crate::decode::x512::scores(q, dh, k, s) };
                return true;
            }
            #[cfg(target_arch = "x86_64")]
            if L == AVX2 {
                // SAFETY: as above (AVX2, FMA, F16C).
                unsafe { crate::decode::x256::scores(q, dh, k, s) };
                return true;
            }
            let _ = (q, dh, k, s);
            false
        }
        #[inline(always)]
        fn accumulate_rows_simd<const L: u8>(
            acc: &mut [f32],
            dh: usize,
            p: &[f32],
            v: &[Self],
        ) -> bool {
            #[cfg(target_arch = "x86_64")]
            if L == AVX512 {
                // SAFETY: as in `scores_simd`.
                unsafe { crate::decode::x512::accumulate_rows(acc, dh, p, v) };
                return true;
            }
            #[cfg(target_arch = "x86_64")]
            if L == AVX2 {
                // SAFETY: as in `scores_simd`.
                unsafe { crate::decode::x256::accumulate_rows(acc, dh, p, v) };
                return true;
            }
            let _ = (acc, dh, p, v);
            false
        }
    };
}

/// Q8_0: its AVX-512 and AVX2 forms (`x512`, `x256`).
impl BlockRead for BlockQ8_0 {
    #[inline(always)]
    fn dot_simd<const L: u8>(q: &[f32], k: &[BlockQ8_0]) -> Option<f32> {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: L names features the enclosing body was compiled for (see `PORTABLE`).
            if L == AVX512 {
                return Some(unsafe { x512::dot_q8_0(q, k) });
            }
            if L == AVX2 {
                return Some(unsafe { x256::dot_q8_0(q, k) });
            }
        }
        let _ = (q, k);
        None
    }
    #[inline(always)]
    fn accumulate_simd<const L: u8>(acc: &mut [f32], p: &[f32], v: &[BlockQ8_0]) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: L names features the enclosing body was compiled for (see `PORTABLE`).
            if L == AVX512 {
                unsafe { x512::accumulate_q8_0(acc, p, v) };
                return true;
            }
            if L == AVX2 {
                unsafe { x256::accumulate_q8_0(acc, p, v) };
                return true;
            }
        }
        let _ = (acc, p, v);
        false
    }
    int8_grouped!();
}
impl BlockRead for BlockQ4_0 {}
impl BlockRead for BlockQ4_1 {}
impl BlockRead for BlockQ5_0 {}
impl BlockRead for BlockQ5_1 {}
/// mlx-lm's 8-bit affine groups: the portable loops (a group read as its 32-value parts), and
/// decode's grouped AVX-512 and AVX2 kernels.
impl<const N: usize> BlockRead for BlockAffine<8, N> {
    int8_grouped!();
}
/// mlx-lm's 4-bit affine groups: the portable loops, a group read as its 32-value parts.
impl<const N: usize> BlockRead for BlockAffine<4, N> {}

/// `Σ_b (d_b · Σ_i q[32b + i] · x_b[i] + m_b · Σ_i q[32b + i])` over a row of blocks' 32-value
/// parts `b` (the offset term for the types that have one): per part, 32 products in 16 lanes
/// (two multiply-adds each), then one multiply-add by its scale into 16 running sums; one
/// horizontal sum at the end.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn dot_blocks<B: KvBlock>(q: &[f32], k: &[B]) -> f32 {
    let mut lanes = [0f32; 16];
    for (i, qb) in q.chunks_exact(Q8_0_VALUES).enumerate() {
        let qb: &[f32; Q8_0_VALUES] = qb.try_into().expect("a block of 32");
        let (d, m, x) = k[i / B::SUBS].unpack(i % B::SUBS);
        let mut s = [0f32; 16];
        for u in 0..16 {
            s[u] = qb[u].mul_add(x[u], s[u]);
            s[u] = qb[u + 16].mul_add(x[u + 16], s[u]);
        }
        for u in 0..16 {
            lanes[u] = d.mul_add(s[u], lanes[u]);
        }
        if B::HAS_MIN {
            for u in 0..16 {
                lanes[u] = m.mul_add(qb[u] + qb[u + 16], lanes[u]);
            }
        }
    }
    sum16(&lanes)
}

/// `acc += Σ_j p[j] * v[j]` over value rows of blocks `v (p.len(), Dh / B::VALUES)`: 32
/// columns (a block's part) stay in registers across the rows, each row adding `(p[j] · d) ·
/// x[i]`; the rows' offsets `p[j] · m` (the same for the part's 32 columns) are summed apart and
/// added once.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn accumulate_blocks<B: KvBlock>(acc: &mut [f32], p: &[f32], v: &[B]) {
    let rw = acc.len() / B::VALUES;
    assert!(v.len() >= p.len() * rw);
    for (ci, ac) in acc.chunks_exact_mut(Q8_0_VALUES).enumerate() {
        let (bi, sub) = (ci / B::SUBS, ci % B::SUBS);
        let mut loc: [f32; Q8_0_VALUES] = (&*ac).try_into().expect("a block of 32");
        let mut off = 0f32;
        for (j, &pj) in p.iter().enumerate() {
            let (d, m, x) = v[j * rw + bi].unpack(sub);
            let w = pj * d;
            for u in 0..Q8_0_VALUES {
                loc[u] = w.mul_add(x[u], loc[u]);
            }
            if B::HAS_MIN {
                off = pj.mul_add(m, off);
            }
        }
        for (a, l) in ac.iter_mut().zip(&loc) {
            *a = if B::HAS_MIN { l + off } else { *l };
        }
    }
}

/// Query rows per tile.
const QT: usize = 8;
/// Keys per block.
const KB: usize = 32;

/// `e^x` for `x <= 0` (and moderately positive x), vectorisable: `2^(x log2 e)` split into an
/// integer power of two and a degree-6 polynomial on [-0.5, 0.5].
#[inline(always)]
pub(crate) fn exp_fast(x: f32) -> f32 {
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
fn accumulate<T: KvRead + KvScalar>(acc: &mut [f32], p: &[f32], v: &[T]) {
    const CH: usize = 64;
    let dh = acc.len();
    let mut c = 0;
    while c + CH <= dh {
        let mut loc: [f32; CH] = acc[c..c + CH].try_into().expect("a chunk");
        for (j, &pj) in p.iter().enumerate() {
            let vr: &[T; CH] = v[j * dh + c..j * dh + c + CH].try_into().expect("a chunk");
            for u in 0..CH {
                loc[u] = pj.mul_add(vr[u].to_f32(), loc[u]);
            }
        }
        acc[c..c + CH].copy_from_slice(&loc);
        c += CH;
    }
    if c < dh {
        for (j, &pj) in p.iter().enumerate() {
            let vr = &v[j * dh + c..(j + 1) * dh];
            for (av, &vv) in acc[c..].iter_mut().zip(vr) {
                *av = pj.mul_add(vv.to_f32(), *av);
            }
        }
    }
}

/// One kv head's keys (transposed, `(Dh, S)` in rows `s_all >= S` apart) and values (`(S, Dh)`
/// rows from position 0), in f32.
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
pub fn attention<K: KvRead, V: KvRead>(
    q: &Tensor,
    cache: &LayerCache<'_, K, V>,
    pos0: usize,
    p: &AttentionParams,
) -> Result<Tensor> {
    attention_on(Isa::best(), q, cache, pos0, p)
}

/// [`attention`] with the kernels of `isa` (x86-64: AVX-512, AVX2; anything else runs the
/// portable loops), so that tests can hold each form to the others on one machine.
pub(crate) fn attention_on<K: KvRead, V: KvRead>(
    isa: Isa,
    q: &Tensor,
    cache: &LayerCache<'_, K, V>,
    pos0: usize,
    p: &AttentionParams,
) -> Result<Tensor> {
    if !isa.is_available() {
        return Err(Error::Msg(format!(
            "attention: this CPU cannot run {isa:?} code"
        )));
    }
    let t = hf2q_tensor::op::check_attention(q, cache, pos0, p)?;
    if t == 1 {
        return crate::decode::decode(isa, q, cache, pos0, p);
    }
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    // A key and a value row's lengths in elements (Dh, or Dh / 32 blocks).
    let (rk, rv) = (dh / K::VALUES, dh / V::VALUES);
    let width = h * dh;
    let total = pos0 + t;
    let group = h / hkv;
    let qd = q.data();
    // Kᵀ of each kv head over the keys any row of this call sees, in f32: (Dh, S) with
    // S = pos0 + T, rows `s_all` apart: S rounded up to 16 and each row 64-byte aligned, so that
    // the vector loads of a block of keys do not straddle cache lines.
    let s_all = total.div_ceil(16) * 16;
    let kts: Vec<(Vec<f32>, usize)> = (0..hkv)
        .into_par_iter()
        .map(|g| {
            let kbase = g * cache.capacity * rk;
            let mut buf = vec![0f32; dh * s_all + 16];
            let off = buf.as_ptr().align_offset(64).min(16);
            let kt = &mut buf[off..off + dh * s_all];
            let mut row = vec![0f32; dh];
            // Centred keys (`KeyCentre`): a sink position's f16 row, a later one's plane row
            // plus the head's centre at its position (so its scores are `q · dq + q · c(j)`
            // within f32 rounding).
            let sinks = cache.centre.map_or(0, |c| c.sinks).min(total);
            if let Some(c) = &cache.centre {
                for j in 0..sinks {
                    let krow = as_f32(isa, c.sink_row(g, j, dh), &mut row);
                    for (d, &kv) in krow.iter().enumerate() {
                        kt[d * s_all + j] = kv;
                    }
                }
            }
            // `(S - sinks, Dh)` centres of a centre that rotates, else the head's one.
            let centres = cache.centre.map(|c| match c.rotates() {
                true => {
                    let mut cs = vec![0f32; (total - sinks) * dh];
                    c.centres(g, sinks, &mut cs, dh);
                    (cs, dh)
                }
                false => (c.centre(g, dh).to_vec(), 0),
            });
            for j in sinks..total {
                let krow = as_f32(
                    isa,
                    &cache.k[kbase + j * rk..kbase + (j + 1) * rk],
                    &mut row,
                );
                match &centres {
                    Some((cs, stride)) => {
                        let cj = &cs[(j - sinks) * stride..][..dh];
                        for (d, (&kv, &cd)) in krow.iter().zip(cj).enumerate() {
                            kt[d * s_all + j] = kv + cd;
                        }
                    }
                    _ => {
                        for (d, &kv) in krow.iter().enumerate() {
                            kt[d * s_all + j] = kv;
                        }
                    }
                }
            }
            (buf, off)
        })
        .collect();
    // Each kv head's values over positions 0..S in f32: an f32 cache's own rows; an f16 cache's
    // widened once per call, as the keys are above (every query row of the head reads them: once
    // per call costs less than once per tile or per row, and as much memory as Kᵀ).
    let vs: Vec<std::borrow::Cow<'_, [f32]>> = (0..hkv)
        .into_par_iter()
        .map(|g| {
            let src = &cache.v[g * cache.capacity * rv..g * cache.capacity * rv + total * rv];
            match V::as_f32(src) {
                Some(v) => std::borrow::Cow::Borrowed(v),
                None => {
                    let mut buf = vec![0f32; total * dh];
                    as_f32(isa, src, &mut buf);
                    std::borrow::Cow::Owned(buf)
                }
            }
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
                    v: &vs[g],
                };
                let out = tile_dispatch(isa, qd, &kv, pos0, p, g, r0, n, tile);
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

/// `Σ a[i] * b[i]` in 16 interleaved partial sums (one vector of multiply-adds).
#[inline(always)]
fn dot16<T: KvRead + KvScalar>(a: &[f32], b: &[T]) -> f32 {
    let mut lanes = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = x.mul_add(y.to_f32(), tail);
    }
    for (x, y) in ca.zip(cb) {
        let x: &[f32; 16] = x.try_into().expect("a chunk of 16");
        let y: &[T; 16] = y.try_into().expect("a chunk of 16");
        for u in 0..16 {
            lanes[u] = x[u].mul_add(y[u].to_f32(), lanes[u]);
        }
    }
    sum16(&lanes) + tail
}

/// The sum of 16 values, by halving.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
pub(crate) fn sum16(v: &[f32; 16]) -> f32 {
    let mut h = [0f32; 8];
    for u in 0..8 {
        h[u] = v[u] + v[u + 8];
    }
    (h[0] + h[4]) + (h[1] + h[5]) + ((h[2] + h[6]) + (h[3] + h[7]))
}

/// `src` as f32: itself for an f32 cache, else widened into the start of `buf` (at least as
/// long) with the kernels of `isa` (available: checked by [`attention_on`]).
fn as_f32<'a, T: KvRead>(isa: Isa, src: &'a [T], buf: &'a mut [f32]) -> &'a [f32] {
    if let Some(v) = T::as_f32(src) {
        return v;
    }
    let out = &mut buf[..src.len() * T::VALUES];
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        unsafe fn avx512<T: KvRead>(src: &[T], out: &mut [f32]) {
            T::widen::<AVX512>(src, out)
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn avx2<T: KvRead>(src: &[T], out: &mut [f32]) {
            T::widen::<AVX2>(src, out)
        }
        if isa == Isa::Avx512Vnni {
            // SAFETY: the CPU has AVX-512 F/BW/VL, FMA and F16C (`isa` is available).
            unsafe { avx512(src, out) };
            return out;
        }
        if isa == Isa::Avx2 {
            // SAFETY: the CPU has AVX2, FMA and F16C (`isa` is available).
            unsafe { avx2(src, out) };
            return out;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    T::widen::<PORTABLE>(src, out);
    out
}

/// [`tile_rows`] compiled for `isa` (available: checked by [`attention_on`]; the loops are
/// written to vectorise).
#[allow(clippy::too_many_arguments)]
fn tile_dispatch(
    isa: Isa,
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
        if isa == Isa::Avx512Vnni {
            // SAFETY: the CPU has AVX-512 F/BW/VL, FMA and F16C (`isa` is available).
            return unsafe { tile_avx512(qd, kv, pos0, p, g, r0, n, tile) };
        }
        if isa == Isa::Avx2 {
            // SAFETY: the CPU has AVX2, FMA and F16C (`isa` is available).
            return unsafe { tile_avx2(qd, kv, pos0, p, g, r0, n, tile) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    tile_rows::<PORTABLE>(qd, kv, pos0, p, g, r0, n, tile)
}

/// `tile_rows` compiled with the named target features (the same body, vectorised for them).
macro_rules! tile_for_isa {
    ($name:ident, $features:literal, $isa:ident) => {
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
            tile_rows::<$isa>(qd, kv, pos0, p, g, r0, n, tile)
        }
    };
}

tile_for_isa!(
    tile_avx512,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    AVX512
);
tile_for_isa!(tile_avx2, "avx2,fma,f16c", AVX2);

#[cfg(test)]
thread_local! {
    /// Tests: take every row of the prefill tiles one by one (to compare the four-row path with).
    static ONE_ROW_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn one_row_only() -> bool {
    #[cfg(test)]
    return ONE_ROW_ONLY.with(std::cell::Cell::get);
    #[cfg(not(test))]
    false
}

/// One tile: rows `r0..r0+n` of kv head `g` -> their outputs `(n, Dh)`. `L`: the vector unit
/// the caller was compiled for; with AVX-512 the score and softmax steps of a block use
/// [`x512`].
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn tile_rows<const L: u8>(
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
        // Rows that see the whole block, four at a time (AVX-512): every key and value load then
        // feeds four rows. The rest (the diagonal block, window edges) go one by one below.
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut done = [false; QT];
        #[cfg(target_arch = "x86_64")]
        if L == AVX512 && kb == KB && dh.is_multiple_of(16) && !one_row_only() {
            let (mut full, mut nf) = ([0usize; QT], 0);
            for i in 0..n {
                if range[i].0 <= j0 && range[i].1 + 1 >= j0 + KB {
                    full[nf] = i;
                    nf += 1;
                }
            }
            for g4 in full[..nf].chunks_exact(4) {
                let sp = tile.s.as_mut_ptr();
                let ap = acc.as_mut_ptr();
                // SAFETY: L is AVX512 only in `tile_avx512`, which runs where AVX-512 F is; the
                // four rows are distinct, so their score rows (KB floats at i * KB of `tile.s`)
                // and accumulator rows (dh floats at i * dh of `acc`) do not overlap; the
                // block's keys and values are inside the cache (kb == KB keys from j0).
                unsafe {
                    let rows = [g4[0], g4[1], g4[2], g4[3]];
                    x512::scores_block4(
                        rows.map(|i| qrow[i]),
                        kv.kt,
                        s_all,
                        j0,
                        rows.map(|i| sp.add(i * KB)),
                    );
                    for &i in &rows {
                        let sb: &mut [f32; KB] =
                            (&mut *std::ptr::slice_from_raw_parts_mut(sp.add(i * KB), KB))
                                .try_into()
                                .expect("a block of KB scores");
                        let mnew = x512::softmax_block(sb, KB, p.scale, m[i], &mut l[i]);
                        if m[i] != f32::NEG_INFINITY && mnew > m[i] {
                            let c = exp_fast(m[i] - mnew);
                            for v in std::slice::from_raw_parts_mut(ap.add(i * dh), dh) {
                                *v *= c;
                            }
                        }
                        m[i] = mnew;
                    }
                    x512::accumulate4(
                        rows.map(|i| ap.add(i * dh)),
                        rows.map(|i| sp.add(i * KB) as *const f32),
                        kv.v[j0 * dh..(j0 + KB) * dh].as_ptr(),
                        dh,
                    );
                }
                for &i in g4 {
                    done[i] = true;
                }
            }
        }
        for i in 0..n {
            if done[i] {
                continue;
            }
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
            if L == AVX512 {
                // SAFETY: L is AVX512 only in `tile_avx512`, which runs where AVX-512 F is.
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
    // A sink (GPT-OSS) is one more key whose value is zero: it joins the running max and sum
    // once, after the keys, and adds nothing to the accumulator.
    if p.sinks.is_some() {
        for i in 0..n {
            let sink = p.sink(g * group + (r0 + i) % group);
            if sink == f32::NEG_INFINITY {
                continue;
            }
            let mnew = m[i].max(sink);
            if m[i] != f32::NEG_INFINITY && mnew > m[i] {
                let c = exp_fast(m[i] - mnew);
                l[i] *= c;
                acc[i * dh..(i + 1) * dh].iter_mut().for_each(|v| *v *= c);
            }
            l[i] += exp_fast(sink - mnew);
        }
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

    use half::f16;
    use hf2q_tensor::kv::BlockQ8_0;
    use hf2q_tensor::op::f16_bits_to_f32;

    use super::KB;

    /// 16 i8 from `p` widened to f32.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; `p..p+16` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16_i8(p: *const i8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }

    /// `Σ_b d_b · Σ_i q[32b + i] · qs_b[i]` over Q8_0 blocks: a block's 32 products in one
    /// 16-lane register, then one multiply-add by its scale.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_q8_0(q: &[f32], k: &[BlockQ8_0]) -> f32 {
        let nb = k.len().min(q.len() / 32);
        let pq = q.as_ptr();
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut b = 0;
        // Two blocks at a time into two sums, so that the scale multiply-adds are two chains.
        while b + 2 <= nb {
            for (acc, bb) in [(&mut a0, b), (&mut a1, b + 1)] {
                let blk = k.get_unchecked(bb);
                let (x, qs) = (pq.add(32 * bb), blk.qs.as_ptr());
                let s = _mm512_fmadd_ps(
                    _mm512_loadu_ps(x),
                    load16_i8(qs),
                    _mm512_mul_ps(_mm512_loadu_ps(x.add(16)), load16_i8(qs.add(16))),
                );
                let d = _mm512_set1_ps(f16_bits_to_f32(blk.d.to_bits()));
                *acc = _mm512_fmadd_ps(d, s, *acc);
            }
            b += 2;
        }
        if b < nb {
            let blk = k.get_unchecked(b);
            let (x, qs) = (pq.add(32 * b), blk.qs.as_ptr());
            let s = _mm512_fmadd_ps(
                _mm512_loadu_ps(x),
                load16_i8(qs),
                _mm512_mul_ps(_mm512_loadu_ps(x.add(16)), load16_i8(qs.add(16))),
            );
            let d = _mm512_set1_ps(f16_bits_to_f32(blk.d.to_bits()));
            a0 = _mm512_fmadd_ps(d, s, a0);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(a0, a1))
    }

    /// `acc += Σ_j p[j] * v[j]` over value rows of Q8_0 blocks `v (p.len(), Dh / 32)`: a
    /// block's 32 columns in two registers across the rows, `(p[j] · d)` broadcast.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn accumulate_q8_0(acc: &mut [f32], p: &[f32], v: &[BlockQ8_0]) {
        let rw = acc.len() / 32;
        assert!(v.len() >= p.len() * rw);
        let pa = acc.as_mut_ptr();
        for bi in 0..rw {
            let a = pa.add(32 * bi);
            let (mut r0, mut r1) = (_mm512_loadu_ps(a), _mm512_loadu_ps(a.add(16)));
            for (j, &pj) in p.iter().enumerate() {
                let blk = v.get_unchecked(j * rw + bi);
                let w = _mm512_set1_ps(pj * f16_bits_to_f32(blk.d.to_bits()));
                let qs = blk.qs.as_ptr();
                r0 = _mm512_fmadd_ps(w, load16_i8(qs), r0);
                r1 = _mm512_fmadd_ps(w, load16_i8(qs.add(16)), r1);
            }
            _mm512_storeu_ps(a, r0);
            _mm512_storeu_ps(a.add(16), r1);
        }
    }

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

    /// `n` (at most 16) f16 values from `p` widened to f32, zeros past them; no read past them.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VL; `p..p+n` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_f16(p: *const f16, n: usize) -> __m512 {
        if n >= 16 {
            return _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
        }
        let k = ((1u32 << n) - 1) as __mmask16;
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p as *const i16))
    }

    /// [`dot`] over f16 `b`: each 16 values widened in a register as they are loaded.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VL.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), load_f16(pb.add(i), 16), s0);
            s1 = _mm512_fmadd_ps(
                _mm512_loadu_ps(pa.add(i + 16)),
                load_f16(pb.add(i + 16), 16),
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
                load_f16(pb.add(i), m0),
                s0,
            );
            if n - i > 16 {
                let m1 = n - i - 16;
                let k1: __mmask16 = ((1u32 << m1) - 1) as __mmask16;
                s1 = _mm512_fmadd_ps(
                    _mm512_maskz_loadu_ps(k1, pa.add(i + 16)),
                    load_f16(pb.add(i + 16), m1),
                    s1,
                );
            }
        }
        _mm512_reduce_add_ps(_mm512_add_ps(s0, s1))
    }

    /// `out = v` widened to f32, 16 values per instruction.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VL.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn widen_f16(v: &[f16], out: &mut [f32]) {
        let n = v.len().min(out.len());
        let (pv, po) = (v.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i < n {
            let m = (n - i).min(16);
            let k = ((1u32 << m) - 1) as __mmask16;
            _mm512_mask_storeu_ps(po.add(i), k, load_f16(pv.add(i), m));
            i += m;
        }
    }

    /// `acc += Σ_j p[j] * v[j]` over f16 value rows `v (p.len(), Dh)`, `Dh = acc.len()`: 64
    /// columns at a time in four registers across the rows (as the f32 loop), then 16, then
    /// the last few under a mask.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VL.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn accumulate_f16(acc: &mut [f32], p: &[f32], v: &[f16]) {
        let dh = acc.len();
        assert!(v.len() >= p.len() * dh);
        let (pa, pv) = (acc.as_mut_ptr(), v.as_ptr());
        let mut c = 0;
        while c + 64 <= dh {
            let mut r = [
                _mm512_loadu_ps(pa.add(c)),
                _mm512_loadu_ps(pa.add(c + 16)),
                _mm512_loadu_ps(pa.add(c + 32)),
                _mm512_loadu_ps(pa.add(c + 48)),
            ];
            for (j, &pj) in p.iter().enumerate() {
                let w = _mm512_set1_ps(pj);
                let row = pv.add(j * dh + c);
                r[0] = _mm512_fmadd_ps(w, load_f16(row, 16), r[0]);
                r[1] = _mm512_fmadd_ps(w, load_f16(row.add(16), 16), r[1]);
                r[2] = _mm512_fmadd_ps(w, load_f16(row.add(32), 16), r[2]);
                r[3] = _mm512_fmadd_ps(w, load_f16(row.add(48), 16), r[3]);
            }
            for (u, x) in r.iter().enumerate() {
                _mm512_storeu_ps(pa.add(c + 16 * u), *x);
            }
            c += 64;
        }
        while c < dh {
            let m = (dh - c).min(16);
            let k = ((1u32 << m) - 1) as __mmask16;
            let mut r = _mm512_maskz_loadu_ps(k, pa.add(c));
            for (j, &pj) in p.iter().enumerate() {
                r = _mm512_fmadd_ps(_mm512_set1_ps(pj), load_f16(pv.add(j * dh + c), m), r);
            }
            _mm512_mask_storeu_ps(pa.add(c), k, r);
            c += m;
        }
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

    /// [`scores_block`] for four query rows at once (`q[r]` -> `s[r]`, each `KB` floats): every
    /// key load feeds four rows' multiply-adds instead of one. The same two chains per row as
    /// [`scores_block`], so each row's scores are bit-identical to it.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; each `s[r]` must point to `KB` writable floats, and
    /// `(dh - 1) * s_all + a + KB <= kt.len()` with `dh` the rows' common length.
    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)]
    pub(super) unsafe fn scores_block4(
        q: [&[f32]; 4],
        kt: &[f32],
        s_all: usize,
        a: usize,
        s: [*mut f32; 4],
    ) {
        let dh = q[0].len();
        assert!(dh > 0 && q.iter().all(|r| r.len() == dh));
        assert!((dh - 1) * s_all + a + KB <= kt.len());
        let k = kt.as_ptr().add(a);
        let z = _mm512_setzero_ps();
        // [row][even lo, even hi, odd lo, odd hi]
        let mut e = [[z; 4]; 4];
        let mut d = 0;
        while d + 2 <= dh {
            let (k0, k1) = (k.add(d * s_all), k.add((d + 1) * s_all));
            let (a0, a1) = (_mm512_loadu_ps(k0), _mm512_loadu_ps(k0.add(16)));
            let (b0, b1) = (_mm512_loadu_ps(k1), _mm512_loadu_ps(k1.add(16)));
            for r in 0..4 {
                let (q0, q1) = (_mm512_set1_ps(q[r][d]), _mm512_set1_ps(q[r][d + 1]));
                e[r][0] = _mm512_fmadd_ps(q0, a0, e[r][0]);
                e[r][1] = _mm512_fmadd_ps(q0, a1, e[r][1]);
                e[r][2] = _mm512_fmadd_ps(q1, b0, e[r][2]);
                e[r][3] = _mm512_fmadd_ps(q1, b1, e[r][3]);
            }
            d += 2;
        }
        if d < dh {
            let k0 = k.add(d * s_all);
            let (a0, a1) = (_mm512_loadu_ps(k0), _mm512_loadu_ps(k0.add(16)));
            for r in 0..4 {
                let q0 = _mm512_set1_ps(q[r][d]);
                e[r][0] = _mm512_fmadd_ps(q0, a0, e[r][0]);
                e[r][1] = _mm512_fmadd_ps(q0, a1, e[r][1]);
            }
        }
        for r in 0..4 {
            _mm512_storeu_ps(s[r], _mm512_add_ps(e[r][0], e[r][2]));
            _mm512_storeu_ps(s[r].add(16), _mm512_add_ps(e[r][1], e[r][3]));
        }
    }

    /// `acc[r] += Σ_j p[r][j] * v[j]` for four rows over one block's `KB` value rows (`v`, rows
    /// `dh` apart, `dh % 16 == 0`): each value load feeds four rows. Per element the same
    /// order as [`super::accumulate`] (keys in turn, one multiply-add each), so bit-identical
    /// to it.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; `acc[r]` must point to `dh` writable floats, `p[r]` to `KB`
    /// readable ones, `v` to `KB * dh`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn accumulate4(
        acc: [*mut f32; 4],
        p: [*const f32; 4],
        v: *const f32,
        dh: usize,
    ) {
        let mut c = 0;
        while c + 64 <= dh {
            acc4_cols::<4>(acc, p, v, dh, c);
            c += 64;
        }
        while c < dh {
            acc4_cols::<1>(acc, p, v, dh, c);
            c += 16;
        }
    }

    /// [`accumulate4`] for columns `c .. c + 16 W` (W a constant, so the 4 W sums stay in
    /// registers).
    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn acc4_cols<const W: usize>(
        acc: [*mut f32; 4],
        p: [*const f32; 4],
        v: *const f32,
        dh: usize,
        c: usize,
    ) {
        let mut r = [[_mm512_setzero_ps(); W]; 4];
        for row in 0..4 {
            for u in 0..W {
                r[row][u] = _mm512_loadu_ps(acc[row].add(c + 16 * u));
            }
        }
        for j in 0..KB {
            let vr = v.add(j * dh + c);
            let mut vv = [_mm512_setzero_ps(); W];
            for u in 0..W {
                vv[u] = _mm512_loadu_ps(vr.add(16 * u));
            }
            for row in 0..4 {
                let pj = _mm512_set1_ps(*p[row].add(j));
                for u in 0..W {
                    r[row][u] = _mm512_fmadd_ps(pj, vv[u], r[row][u]);
                }
            }
        }
        for row in 0..4 {
            for u in 0..W {
                _mm512_storeu_ps(acc[row].add(c + 16 * u), r[row][u]);
            }
        }
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

/// AVX2 forms of the f16 row reads (F16C widens 8 values per instruction; the f32 reads are
/// the portable loops, which the compiler vectorises for AVX2 by itself).
#[cfg(target_arch = "x86_64")]
mod x256 {
    use std::arch::x86_64::*;

    use half::f16;
    use hf2q_tensor::kv::BlockQ8_0;
    use hf2q_tensor::op::f16_bits_to_f32;

    /// 8 i8 from `p` widened to f32.
    ///
    /// # Safety
    /// The CPU must have AVX2; `p..p+8` must be readable.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8_i8(p: *const i8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }

    /// `Σ_b d_b · Σ_i q[32b + i] · qs_b[i]` over Q8_0 blocks: a block's 32 products in two
    /// 8-lane chains, then one multiply-add by its scale.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_q8_0(q: &[f32], k: &[BlockQ8_0]) -> f32 {
        let nb = k.len().min(q.len() / 32);
        let pq = q.as_ptr();
        let mut acc = _mm256_setzero_ps();
        for (b, blk) in k[..nb].iter().enumerate() {
            let (x, qs) = (pq.add(32 * b), blk.qs.as_ptr());
            let s0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(x),
                load8_i8(qs),
                _mm256_mul_ps(_mm256_loadu_ps(x.add(8)), load8_i8(qs.add(8))),
            );
            let s1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(x.add(16)),
                load8_i8(qs.add(16)),
                _mm256_mul_ps(_mm256_loadu_ps(x.add(24)), load8_i8(qs.add(24))),
            );
            let d = _mm256_set1_ps(f16_bits_to_f32(blk.d.to_bits()));
            acc = _mm256_fmadd_ps(d, _mm256_add_ps(s0, s1), acc);
        }
        hsum(acc)
    }

    /// `acc += Σ_j p[j] * v[j]` over value rows of Q8_0 blocks `v (p.len(), Dh / 32)`: a
    /// block's 32 columns in four registers across the rows, `(p[j] · d)` broadcast.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn accumulate_q8_0(acc: &mut [f32], p: &[f32], v: &[BlockQ8_0]) {
        let rw = acc.len() / 32;
        assert!(v.len() >= p.len() * rw);
        let pa = acc.as_mut_ptr();
        for bi in 0..rw {
            let a = pa.add(32 * bi);
            let mut r = [
                _mm256_loadu_ps(a),
                _mm256_loadu_ps(a.add(8)),
                _mm256_loadu_ps(a.add(16)),
                _mm256_loadu_ps(a.add(24)),
            ];
            for (j, &pj) in p.iter().enumerate() {
                let blk = v.get_unchecked(j * rw + bi);
                let w = _mm256_set1_ps(pj * f16_bits_to_f32(blk.d.to_bits()));
                let qs = blk.qs.as_ptr();
                r[0] = _mm256_fmadd_ps(w, load8_i8(qs), r[0]);
                r[1] = _mm256_fmadd_ps(w, load8_i8(qs.add(8)), r[1]);
                r[2] = _mm256_fmadd_ps(w, load8_i8(qs.add(16)), r[2]);
                r[3] = _mm256_fmadd_ps(w, load8_i8(qs.add(24)), r[3]);
            }
            for (u, x) in r.iter().enumerate() {
                _mm256_storeu_ps(a.add(8 * u), *x);
            }
        }
    }

    /// 8 f16 values from `p` widened to f32.
    ///
    /// # Safety
    /// The CPU must have AVX and F16C; `p..p+8` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// The sum of 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum(x: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// `Σ a[i] * b[i]` over the shorter length, f16 `b` widened as it is loaded: 8 lanes in two
    /// chains, the last 0..7 values one by one.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), load8(pb.add(i)), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), load8(pb.add(i + 8)), s1);
            i += 16;
        }
        if i + 8 <= n {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), load8(pb.add(i)), s0);
            i += 8;
        }
        let mut t = hsum(_mm256_add_ps(s0, s1));
        for j in i..n {
            t = a[j].mul_add(b[j].to_f32(), t);
        }
        t
    }

    /// `out = v` widened to f32, 8 values per instruction.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn widen_f16(v: &[f16], out: &mut [f32]) {
        let n = v.len().min(out.len());
        let (pv, po) = (v.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(po.add(i), load8(pv.add(i)));
            i += 8;
        }
        for j in i..n {
            out[j] = v[j].to_f32();
        }
    }

    /// `acc += Σ_j p[j] * v[j]` over f16 value rows `v (p.len(), Dh)`, `Dh = acc.len()`: 32
    /// columns at a time in four registers across the rows, then 8, then one by one.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn accumulate_f16(acc: &mut [f32], p: &[f32], v: &[f16]) {
        let dh = acc.len();
        assert!(v.len() >= p.len() * dh);
        let (pa, pv) = (acc.as_mut_ptr(), v.as_ptr());
        let mut c = 0;
        while c + 32 <= dh {
            let mut r = [
                _mm256_loadu_ps(pa.add(c)),
                _mm256_loadu_ps(pa.add(c + 8)),
                _mm256_loadu_ps(pa.add(c + 16)),
                _mm256_loadu_ps(pa.add(c + 24)),
            ];
            for (j, &pj) in p.iter().enumerate() {
                let w = _mm256_set1_ps(pj);
                let row = pv.add(j * dh + c);
                r[0] = _mm256_fmadd_ps(w, load8(row), r[0]);
                r[1] = _mm256_fmadd_ps(w, load8(row.add(8)), r[1]);
                r[2] = _mm256_fmadd_ps(w, load8(row.add(16)), r[2]);
                r[3] = _mm256_fmadd_ps(w, load8(row.add(24)), r[3]);
            }
            for (u, x) in r.iter().enumerate() {
                _mm256_storeu_ps(pa.add(c + 8 * u), *x);
            }
            c += 32;
        }
        while c + 8 <= dh {
            let mut r = _mm256_loadu_ps(pa.add(c));
            for (j, &pj) in p.iter().enumerate() {
                r = _mm256_fmadd_ps(_mm256_set1_ps(pj), load8(pv.add(j * dh + c)), r);
            }
            _mm256_storeu_ps(pa.add(c), r);
            c += 8;
        }
        for (cc, a) in acc.iter_mut().enumerate().skip(c) {
            for (j, &pj) in p.iter().enumerate() {
                *a = pj.mul_add(v[j * dh + cc].to_f32(), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::KvRead;
    use super::{attention_on, exp_fast, Isa};
    use crate::decode::decode_head_on;
    use hf2q_tensor::op::{AttentionParams, LayerCache};
    use hf2q_tensor::Tensor;

    /// Uniform values in [-1, 1) from a xorshift generator seeded with `seed`.
    fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        }
    }

    #[test]
    fn silu_mul_matches_the_reference() {
        let g: Vec<f32> = (0..100_000)
            .map(|i| ((i * 7919) % 20011) as f32 / 20011.0 * 200.0 - 100.0)
            .chain([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 1e4, -1e4])
            .collect();
        let u: Vec<f32> = (0..g.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let got = super::silu_mul(&g, &u);
        for ((&g, &u), &y) in g.iter().zip(&u).zip(&got) {
            let want = crate::silu(g) * u;
            assert!(
                // exp_fast's error grows as |x| * 1e-7 (the rounding of x * log2 e), and below
                // g = -87 it stops at e^-87: outputs under 1e-33 instead of 0.
                (y - want).abs() <= (2e-6 + 1e-7 * g.abs()) * want.abs() + 1e-30 * u.abs(),
                "silu({g}) * {u}: {y} vs {want}"
            );
        }
    }

    /// The prefill tiles' four-row path (AVX-512) gives exactly the bits of the one-row path:
    /// the same operations in the same order per row.
    #[test]
    fn four_row_prefill_equals_one_row() {
        if Isa::best() != Isa::Avx512Vnni {
            println!("skipped: no AVX-512 on this CPU");
            return;
        }
        let mut f = uniform(0x0bad_cafe_1234_5678u64);
        for &(h, hkv, dh) in &[(9, 3, 64), (8, 2, 128), (4, 4, 32), (2, 1, 48)] {
            for &(t, pos0, window) in &[(70, 0, None), (45, 30, None), (64, 0, Some(40))] {
                let cap = pos0 + t;
                let p = AttentionParams {
                    n_heads: h,
                    n_kv_heads: hkv,
                    head_dim: dh,
                    scale: 1.0 / (dh as f32).sqrt(),
                    window,
                    sinks: None,
                };
                let k: Vec<f32> = (0..hkv * cap * dh).map(|_| 3.0 * f()).collect();
                let v: Vec<f32> = (0..hkv * cap * dh).map(|_| f()).collect();
                let q = Tensor::new(&[t, h * dh], (0..t * h * dh).map(|_| f()).collect()).unwrap();
                let cache = LayerCache {
                    k: &k,
                    v: &v,
                    capacity: cap,
                    centre: None,
                };
                // One pool thread, so that the switch (a thread-local) reaches every tile.
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .unwrap();
                let run = |one: bool| {
                    pool.install(|| {
                        super::ONE_ROW_ONLY.with(|c| c.set(one));
                        let out = attention_on(Isa::Avx512Vnni, &q, &cache, pos0, &p);
                        super::ONE_ROW_ONLY.with(|c| c.set(false));
                        out.unwrap()
                    })
                };
                let (four, one) = (run(false), run(true));
                let same = four
                    .data()
                    .iter()
                    .zip(one.data())
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "h {h} hkv {hkv} dh {dh} t {t} pos0 {pos0} window {window:?}"
                );
            }
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

    /// The decode head (portable, AVX2 and AVX-512 forms, f32 and f16 caches) against a plain
    /// f64 softmax-weighted sum of the stored values, for head widths with and without a partial
    /// 8/16/32-lane tail and contexts of 1..=40 keys. Allowed: 1e-5 relative to Σ p |v| (the f32
    /// sums and `exp_fast`'s 5e-7 relative error; f16 values widen exactly, so the same bound).
    #[test]
    fn decode_head_matches_f64() {
        decode_head_case::<f32>(|x| x);
        decode_head_case::<f16>(f16::from_f32);
    }

    fn decode_head_case<T: KvRead + hf2q_tensor::op::KvScalar>(store: fn(f32) -> T) {
        let mut f = uniform(0x1234_5678_9abc_def1u64);
        let mut s = Vec::new();
        // No visible key: zeros, as the reference's empty sum.
        let mut o = vec![f32::NAN; 8];
        decode_head_on::<T, T>(
            Isa::Scalar,
            &[1.0; 8],
            &[],
            &[],
            (1.0, f32::NEG_INFINITY),
            &mut s,
            &mut o,
        );
        assert_eq!(o, [0.0; 8]);
        for dh in [8, 16, 37, 40, 64, 100, 128] {
            for n in [1, 2, 17, 40] {
                let q: Vec<f32> = (0..dh).map(|_| 2.0 * f()).collect();
                let k: Vec<T> = (0..n * dh).map(|_| store(2.0 * f())).collect();
                let v: Vec<T> = (0..n * dh).map(|_| store(f())).collect();
                let scale = 1.0 / (dh as f32).sqrt();
                let sc: Vec<f64> = k
                    .chunks(dh)
                    .map(|kr| {
                        q.iter()
                            .zip(kr)
                            .map(|(a, b)| *a as f64 * b.to_f32() as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = p.iter().sum();
                let mut forms: Vec<(&str, Vec<f32>)> = Vec::new();
                let mut o = vec![f32::NAN; dh];
                decode_head_on::<T, T>(
                    Isa::Scalar,
                    &q,
                    &k,
                    &v,
                    (scale, f32::NEG_INFINITY),
                    &mut s,
                    &mut o,
                );
                forms.push(("portable", o.clone()));
                #[cfg(target_arch = "x86_64")]
                {
                    if Isa::Avx2.is_available() {
                        o.fill(f32::NAN);
                        let sm = (scale, f32::NEG_INFINITY);
                        decode_head_on(Isa::Avx2, &q, &k, &v, sm, &mut s, &mut o);
                        forms.push(("avx2", o.clone()));
                    }
                    if Isa::Avx512Vnni.is_available() {
                        o.fill(f32::NAN);
                        let sm = (scale, f32::NEG_INFINITY);
                        decode_head_on(Isa::Avx512Vnni, &q, &k, &v, sm, &mut s, &mut o);
                        forms.push(("avx512", o.clone()));
                    }
                }
                for (name, o) in forms {
                    for c in 0..dh {
                        let vc = |j: usize| v[j * dh + c].to_f32() as f64;
                        let want: f64 = (0..n).map(|j| p[j] / l * vc(j)).sum::<f64>();
                        let mag: f64 = (0..n).map(|j| p[j] / l * vc(j).abs()).sum::<f64>();
                        assert!(
                            (o[c] as f64 - want).abs() <= 1e-5 * mag + 1e-30,
                            "{name} {} dh={dh} n={n} c={c}: {} vs {want}",
                            std::any::type_name::<T>(),
                            o[c]
                        );
                    }
                }
            }
        }
    }

    /// Every kernel form this CPU runs (portable, AVX2, AVX-512), decode and prefill, over an f16
    /// and an f32 cache: the same stored values, so the forms differ only in summation order.
    /// Awkward sizes: odd head widths and positions, GQA groups, windows, spare capacity.
    /// Allowed: 1e-5 between forms, 2e-5 against the scalar reference (outputs are convex
    /// combinations of values in [-1, 1]; f32 sums of a few hundred terms in another order and
    /// `exp_fast`'s 5e-7).
    #[test]
    fn every_isa_agrees_on_f16_and_f32_caches() {
        let isas: Vec<Isa> = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .filter(|i| i.is_available())
            .collect();
        let mut f = uniform(0x2545_f491_4f6c_dd1du64);
        let mut cases = 0;
        for &(h, hkv) in &[(1, 1), (9, 3), (8, 2)] {
            for &dh in &[37, 64, 128] {
                for &(t, pos0) in &[(1, 0), (1, 44), (1, 301), (7, 0), (33, 17), (5, 250)] {
                    for &window in &[None, Some(9)] {
                        let cap = pos0 + t + 13;
                        let p = AttentionParams {
                            n_heads: h,
                            n_kv_heads: hkv,
                            head_dim: dh,
                            scale: 1.0 / (dh as f32).sqrt(),
                            window,
                            sinks: None,
                        };
                        let k: Vec<f32> = (0..hkv * cap * dh).map(|_| 3.0 * f()).collect();
                        let v: Vec<f32> = (0..hkv * cap * dh).map(|_| f()).collect();
                        let q = (0..t * h * dh).map(|_| 3.0 * f()).collect();
                        let q = Tensor::new(&[t, h * dh], q).unwrap();
                        let (kh, vh): (Vec<f16>, Vec<f16>) = (
                            k.iter().map(|&x| f16::from_f32(x)).collect(),
                            v.iter().map(|&x| f16::from_f32(x)).collect(),
                        );
                        let what = format!("h={h} hkv={hkv} dh={dh} t={t} pos0={pos0} {window:?}");
                        let c16 = LayerCache {
                            k: &kh,
                            v: &vh,
                            capacity: cap,
                            centre: None,
                        };
                        let c32 = LayerCache {
                            k: &k,
                            v: &v,
                            capacity: cap,
                            centre: None,
                        };
                        all_forms_agree(&isas, &q, &c16, pos0, &p, &format!("f16 {what}"));
                        all_forms_agree(&isas, &q, &c32, pos0, &p, &format!("f32 {what}"));
                        cases += 1;
                    }
                }
            }
        }
        assert_eq!(cases, 108);
    }

    /// Every kernel form this CPU runs over block caches of every type (and keys and values of
    /// different types; an 8- and a 4-bit affine layout whose groups divide the head, of one,
    /// two or four 32-value parts; decode reads the blocks with each form's dot and weighted
    /// sum; prefill dequantizes rows into its tiles), against the portable form and the
    /// reference over the same blocks.
    #[test]
    fn every_isa_agrees_on_block_caches() {
        use hf2q_tensor::kv::{AffineKv, HostKv, KvType, KvTypes};
        let isas: Vec<Isa> = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .filter(|i| i.is_available())
            .collect();
        let mut f = uniform(0x5851_f42d_4c95_7f2du64);
        for &(h, hkv) in &[(1, 1), (9, 3), (8, 2)] {
            for &dh in &[32, 96, 128] {
                for &(t, pos0) in &[(1, 0), (1, 44), (1, 301), (7, 0), (33, 17)] {
                    for &window in &[None, Some(9)] {
                        let n = pos0 + t;
                        let p = AttentionParams {
                            n_heads: h,
                            n_kv_heads: hkv,
                            head_dim: dh,
                            scale: 1.0 / (dh as f32).sqrt(),
                            window,
                            sinks: None,
                        };
                        let k = (0..n * hkv * dh).map(|_| 3.0 * f()).collect();
                        let v = (0..n * hkv * dh).map(|_| f()).collect();
                        let (kt, vt) = (
                            Tensor::new(&[n, hkv * dh], k).unwrap(),
                            Tensor::new(&[n, hkv * dh], v).unwrap(),
                        );
                        let q = (0..t * h * dh).map(|_| 3.0 * f()).collect();
                        let q = Tensor::new(&[t, h * dh], q).unwrap();
                        let what = format!("h={h} hkv={hkv} dh={dh} t={t} pos0={pos0} {window:?}");
                        // Every block type, and a key type unlike the value type.
                        let split = KvTypes {
                            k: KvType::Q8_0,
                            v: KvType::Q5_1,
                        };
                        let types = KvType::BLOCKS.map(KvTypes::from);
                        let affine = [
                            AffineKv::B8G128,
                            AffineKv::B4G64,
                            AffineKv::B8G32,
                            AffineKv::B4G32,
                        ]
                        .map(KvType::Affine)
                        .into_iter()
                        .filter(|a| a.check_head_dim(dh).is_ok())
                        .take(2)
                        .map(KvTypes::from);
                        for ty in types.into_iter().chain([split]).chain(affine) {
                            let mut kv = HostKv::new(hkv, dh, ty);
                            kv.write(&kt, &vt, 0, n + 5).unwrap();
                            let what = format!("{} {what}", ty.name());
                            let forms = AllForms {
                                isas: &isas,
                                q: &q,
                                pos0,
                                p: &p,
                                what: &what,
                            };
                            crate::kv_view::visit(kv.view(), forms).unwrap();
                        }
                    }
                }
            }
        }
    }

    /// The check of [`all_forms_agree`] as a visitor of a cache of any types.
    struct AllForms<'a> {
        isas: &'a [Isa],
        q: &'a Tensor,
        pos0: usize,
        p: &'a AttentionParams,
        what: &'a str,
    }

    impl crate::kv_view::KvVisit for AllForms<'_> {
        type Out = ();
        fn visit<K: KvRead, V: KvRead>(self, c: &LayerCache<'_, K, V>) {
            all_forms_agree(self.isas, self.q, c, self.pos0, self.p, self.what)
        }
    }

    fn all_forms_agree<K: KvRead, V: KvRead>(
        isas: &[Isa],
        q: &Tensor,
        c: &LayerCache<'_, K, V>,
        pos0: usize,
        p: &AttentionParams,
        what: &str,
    ) {
        let max_err = |a: &Tensor, b: &Tensor| {
            a.data()
                .iter()
                .zip(b.data())
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        };
        let reference = crate::CpuBackend::REFERENCE
            .attention(q, c, pos0, p)
            .unwrap();
        let portable = attention_on(Isa::Scalar, q, c, pos0, p).unwrap();
        let e = max_err(&portable, &reference);
        assert!(e < 2e-5, "{what}: portable vs reference {e}");
        for &isa in isas {
            let got = attention_on(isa, q, c, pos0, p).unwrap();
            let e = max_err(&got, &portable);
            assert!(e < 1e-5, "{what}: {isa:?} vs portable {e}");
        }
    }
}
