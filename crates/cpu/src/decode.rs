//! Attention of one new token (decode, `T = 1`) on the CPU's fast path, by kv head: the query
//! rows of a kv head's group (`G = n_heads / n_kv_heads` heads) are computed together, so that
//! a cache type with a grouped kernel reads and widens each key and value row once for all `G`
//! rows instead of once per query head.
//!
//! For one kv head and a range of its visible keys (a "part"):
//! - scores `s (G, n) = q (G, Dh) · Kᵀ` ([`KvRead::scores`]), scaled;
//! - per row a max `m_r` and `e^(s - m_r)` with their sum `l_r`;
//! - `acc (G, Dh) = Σ_j e^(s_rj - m_r) · v_j` ([`KvRead::accumulate_rows`]), unnormalised.
//!
//! A long context is split into several parts per kv head when there are threads to share it
//! (flash-decoding): each part is an independent work item, and [`combine`] merges the parts of
//! a row, `o = Σ_c e^(m_c - M) acc_c / (Σ_c e^(m_c - M) l_c + e^(sink - M))` with `M` the largest
//! `m_c` (and the head's sink logit, if any). One thread (or a short context) runs one part per
//! kv head, in order.
//!
//! The grouped kernels for 8-bit blocks (ggml's Q8_0, mlx-lm's 8-bit affine groups) are in
//! [`x512`] (AVX-512: each key's integers widened once, the `G` rows' 16-lane sums kept apart
//! and reduced sixteen keys at a time by a transposing tree instead of one horizontal sum per
//! key). Every other type and vector unit reads row by row through [`KvRead::dot`] and
//! [`KvRead::accumulate`]. This is not the prefill path (`attention.rs`'s tiles) nor the
//! reference (`CpuBackend::attention` on the reference path), which the tests hold it to.

use rayon::prelude::*;

use super::attention::{exp_fast, sum16, KvRead, PORTABLE};
#[cfg(target_arch = "x86_64")]
use super::attention::{AVX2, AVX512};
use super::kernels::Isa;
use hf2q_tensor::op::{AttentionParams, LayerCache};
use hf2q_tensor::{Result, Tensor};

/// Fewest keys in a part when a kv head's keys are split over threads.
const MIN_PART: usize = 256;

thread_local! {
    /// Scores of one part (grows to the longest seen, then is reused).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One part's result for its kv head's `G` rows: `(m_r, l_r)` and `acc (G, Dh)` (module header).
struct Part {
    ml: Vec<(f32, f32)>,
    acc: Vec<f32>,
}

/// Attention of one token: `q (1, H * Dh)` over the cache's positions `lo..=pos0` (`lo` from the
/// window) -> `(1, H * Dh)`. Already checked by the caller: `q` is one row, the cache holds
/// `pos0 + 1` positions, `isa` is available.
pub(crate) fn decode<K: KvRead, V: KvRead>(
    isa: Isa,
    q: &Tensor,
    cache: &LayerCache<'_, K, V>,
    pos0: usize,
    p: &AttentionParams,
) -> Result<Tensor> {
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    let (rk, rv) = (dh / K::VALUES, dh / V::VALUES);
    let group = h / hkv;
    let lo = match p.window {
        Some(w) => (pos0 + 1).saturating_sub(w),
        None => 0,
    };
    let n = pos0 + 1 - lo;
    // A head is about 4 * n * Dh flops: hand work to other threads only when that outweighs
    // waking them; then give every thread about two items (kv heads split into parts).
    let threads = rayon::current_num_threads();
    let parallel = threads > 1 && h * n * dh >= 1 << 16;
    let parts = if parallel {
        (2 * threads).div_ceil(hkv).min(n / MIN_PART).max(1)
    } else {
        1
    };
    let len = n.div_ceil(parts).max(1);
    let per_head = n.div_ceil(len);
    let items: Vec<(usize, usize)> = (0..hkv)
        .flat_map(|g| (0..per_head).map(move |c| (g, c * len)))
        .collect();
    let run = |&(g, a): &(usize, usize), s: &mut Vec<f32>| {
        let b = (a + len).min(n);
        let (kb, vb) = (g * cache.capacity * rk, g * cache.capacity * rv);
        let keys = &cache.k[kb + (lo + a) * rk..kb + (lo + b) * rk];
        let vals = &cache.v[vb + (lo + a) * rv..vb + (lo + b) * rv];
        let qg = &q.data()[g * group * dh..(g + 1) * group * dh];
        let mut part = Part {
            ml: vec![(0.0, 0.0); group],
            acc: vec![0f32; group * dh],
        };
        part_on(isa, qg, keys, vals, p.scale, s, &mut part.acc, &mut part.ml);
        part
    };
    let done: Vec<Part> = if parallel && items.len() > 1 {
        items
            .par_iter()
            .map_init(Vec::new, |s, it| run(it, s))
            .collect()
    } else {
        SCORES.with(|c| match c.try_borrow_mut() {
            Ok(mut s) => items.iter().map(|it| run(it, &mut s)).collect(),
            Err(_) => items.iter().map(|it| run(it, &mut Vec::new())).collect(),
        })
    };
    let mut out = vec![0f32; h * dh];
    for (hi, o) in out.chunks_exact_mut(dh).enumerate() {
        let (g, r) = (hi / group, hi % group);
        let mine = done[g * per_head..(g + 1) * per_head]
            .iter()
            .map(|pt| (pt.ml[r], &pt.acc[r * dh..(r + 1) * dh]));
        combine(mine, p.sink(hi), o);
    }
    Tensor::new(&[1, h * dh], out)
}

/// `o = Σ_c e^(m_c - M) acc_c / (Σ_c e^(m_c - M) l_c + e^(sink - M))` over a row's parts
/// `((m_c, l_c), acc_c)`, `M = max(sink, m_c...)`; zeros when there is nothing to weigh (no
/// visible key and no sink: the reference's empty sum).
fn combine<'a>(
    parts: impl Iterator<Item = ((f32, f32), &'a [f32])> + Clone,
    sink: f32,
    o: &mut [f32],
) {
    let big = parts.clone().fold(sink, |a, ((m, _), _)| a.max(m));
    o.fill(0.0);
    let mut l = if sink == f32::NEG_INFINITY {
        0.0
    } else {
        (sink - big).exp()
    };
    for ((m, lc), acc) in parts {
        let w = (m - big).exp();
        l += w * lc;
        for (x, a) in o.iter_mut().zip(acc) {
            *x = w.mul_add(*a, *x);
        }
    }
    if l > 0.0 {
        let inv = 1.0 / l;
        for x in o.iter_mut() {
            *x *= inv;
        }
    }
}

/// One query head `q (Dh)` over key and value rows `k`, `v` (n, Dh) -> `o (Dh)` with the kernels
/// of `isa` (available): one part and [`combine`]. `sm`: the score scale and the head's sink
/// logit (`-inf`: none). `s` is scratch. The kernel tests' entry to one head.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn decode_head_on<K: KvRead, V: KvRead>(
    isa: Isa,
    q: &[f32],
    k: &[K],
    v: &[V],
    sm: (f32, f32),
    s: &mut Vec<f32>,
    o: &mut [f32],
) {
    let mut ml = [(f32::NEG_INFINITY, 0.0)];
    let mut acc = vec![0f32; o.len()];
    if !k.is_empty() {
        part_on(isa, q, k, v, sm.0, s, &mut acc, &mut ml);
    }
    let parts = (!k.is_empty()).then_some((ml[0], &acc[..]));
    combine(parts.into_iter(), sm.1, o);
}

/// [`part`] compiled for `isa` (available).
#[allow(clippy::too_many_arguments)]
fn part_on<K: KvRead, V: KvRead>(
    isa: Isa,
    q: &[f32],
    k: &[K],
    v: &[V],
    scale: f32,
    s: &mut Vec<f32>,
    acc: &mut [f32],
    ml: &mut [(f32, f32)],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx512<K: KvRead, V: KvRead>(
            q: &[f32],
            k: &[K],
            v: &[V],
            scale: f32,
            s: &mut Vec<f32>,
            acc: &mut [f32],
            ml: &mut [(f32, f32)],
        ) {
            part::<AVX512, K, V>(q, k, v, scale, s, acc, ml)
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx2<K: KvRead, V: KvRead>(
            q: &[f32],
            k: &[K],
            v: &[V],
            scale: f32,
            s: &mut Vec<f32>,
            acc: &mut [f32],
            ml: &mut [(f32, f32)],
        ) {
            part::<AVX2, K, V>(q, k, v, scale, s, acc, ml)
        }
        if isa == Isa::Avx512Vnni {
            // SAFETY: the CPU has AVX-512 F/BW/VL, FMA and F16C (`isa` is available).
            return unsafe { avx512(q, k, v, scale, s, acc, ml) };
        }
        if isa == Isa::Avx2 {
            // SAFETY: the CPU has AVX2, FMA and F16C (`isa` is available).
            return unsafe { avx2(q, k, v, scale, s, acc, ml) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    part::<PORTABLE, K, V>(q, k, v, scale, s, acc, ml)
}

/// One part (module header): `q (G, Dh)` over `n >= 1` key and value rows `k`, `v` ->
/// `acc (G, Dh)` unnormalised and `ml[r] = (m_r, l_r)`. `L`: the vector unit the caller was
/// compiled for. Plain loops, no closures: a closure is compiled without the caller's target
/// features, and its `mul_add` would become a library call.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn part<const L: u8, K: KvRead, V: KvRead>(
    q: &[f32],
    k: &[K],
    v: &[V],
    scale: f32,
    s: &mut Vec<f32>,
    acc: &mut [f32],
    ml: &mut [(f32, f32)],
) {
    let g = ml.len();
    let dh = q.len() / g;
    let n = k.len() / (dh / K::VALUES);
    s.clear();
    s.resize(g * n, 0.0);
    K::scores::<L>(q, dh, k, s);
    for (row, ml) in s.chunks_exact_mut(n).zip(ml.iter_mut()) {
        let mut m = f32::NEG_INFINITY;
        for e in row.iter_mut() {
            *e *= scale;
            m = m.max(*e);
        }
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact_mut(16);
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
        *ml = (m, l);
    }
    acc.fill(0.0);
    V::accumulate_rows::<L>(acc, dh, s, v);
}

/// Grouped kernels for blocks of 8-bit parts on AVX-512 (module header).
#[cfg(target_arch = "x86_64")]
pub(crate) mod x512 {
    use std::arch::x86_64::*;

    use hf2q_tensor::kv::{BlockAffine, BlockQ8_0, KvBlock, Q8_0_VALUES};

    /// A block whose 32-value parts are 32 bytes of 8-bit integers `x`, signed (ggml's Q8_0) or
    /// unsigned (mlx-lm's 8-bit affine groups), value `x * d + m` with an f16 scale `d` and
    /// (`KvBlock::HAS_MIN`) an f16 bias `m`.
    pub(crate) trait Int8Parts: KvBlock {
        const SIGNED: bool;
        /// Part `sub`'s scale and bias as f16 bits (bias 0 without one) and its 32 integers.
        fn part(&self, sub: usize) -> (u16, u16, *const u8);
    }

    impl Int8Parts for BlockQ8_0 {
        const SIGNED: bool = true;
        #[inline(always)]
        fn part(&self, _sub: usize) -> (u16, u16, *const u8) {
            (self.d.to_bits(), 0, self.qs.as_ptr() as *const u8)
        }
    }

    impl<const N: usize> Int8Parts for BlockAffine<8, N> {
        const SIGNED: bool = false;
        #[inline(always)]
        fn part(&self, sub: usize) -> (u16, u16, *const u8) {
            let qs = &self.qs[sub * Q8_0_VALUES..(sub + 1) * Q8_0_VALUES];
            (self.scale.to_bits(), self.bias.to_bits(), qs.as_ptr())
        }
    }

    /// 16 integers from `p` widened to f32.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; `p..p+16` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16<B: Int8Parts>(p: *const u8) -> __m512 {
        let x = _mm_loadu_si128(p as *const __m128i);
        _mm512_cvtepi32_ps(if B::SIGNED {
            _mm512_cvtepi8_epi32(x)
        } else {
            _mm512_cvtepu8_epi32(x)
        })
    }

    /// The f32 value of f16 bits (F16C).
    ///
    /// # Safety
    /// The CPU must have F16C.
    #[inline]
    #[target_feature(enable = "f16c")]
    unsafe fn f16x(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// The sums of sixteen vectors, one per lane: lane `4c + k` is the sum of `v[4k + c]` (a
    /// caller storing key `j` at slot `(j % 4) * 4 + j / 4` gets key `j`'s sum in lane `j`).
    /// Pairs of 128-bit chunks, then pairs of floats, added in four levels (45 operations for
    /// 16 sums).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
        let mut p = [_mm512_setzero_ps(); 8];
        for i in 0..8 {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            p[i] = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            );
        }
        let mut q = [_mm512_setzero_ps(); 4];
        for i in 0..4 {
            let (x, y) = (p[2 * i], p[2 * i + 1]);
            q[i] = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(x, y),
                _mm512_shuffle_f32x4::<0xDD>(x, y),
            );
        }
        let mut r = [_mm512_setzero_ps(); 2];
        for i in 0..2 {
            let (x, y) = (q[2 * i], q[2 * i + 1]);
            r[i] = _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(x, y),
                _mm512_shuffle_ps::<0xEE>(x, y),
            );
        }
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(r[0], r[1]),
            _mm512_shuffle_ps::<0xDD>(r[0], r[1]),
        )
    }

    /// `s (G, n) = q (G, Dh) · k (n keys)ᵀ` over 8-bit blocks: rows four at a time.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx512f,fma,f16c")]
    pub(crate) unsafe fn scores<B: Int8Parts>(q: &[f32], dh: usize, k: &[B], s: &mut [f32]) {
        let g = q.len() / dh;
        let n = k.len() / (dh / (B::SUBS * Q8_0_VALUES));
        assert!(dh % Q8_0_VALUES == 0 && q.len() == g * dh && s.len() >= g * n);
        let mut r0 = 0;
        while r0 < g {
            let (qp, sp) = (q.as_ptr().add(r0 * dh), s.as_mut_ptr().add(r0 * n));
            match g - r0 {
                1 => score_rows::<B, 1>(qp, dh, k, n, sp),
                2 => score_rows::<B, 2>(qp, dh, k, n, sp),
                3 => score_rows::<B, 3>(qp, dh, k, n, sp),
                _ => score_rows::<B, 4>(qp, dh, k, n, sp),
            }
            r0 += 4;
        }
    }

    /// [`scores`] for `R` rows at `q` (`R * Dh` values), into `s + r * n`.
    #[inline]
    #[target_feature(enable = "avx512f,fma,f16c")]
    unsafe fn score_rows<B: Int8Parts, const R: usize>(
        q: *const f32,
        dh: usize,
        k: &[B],
        n: usize,
        s: *mut f32,
    ) {
        let parts = dh / Q8_0_VALUES;
        let rw = parts / B::SUBS;
        let mut tmp = [[_mm512_setzero_ps(); 16]; R];
        let mut j0 = 0;
        while j0 < n {
            let m = (n - j0).min(16);
            for jj in 0..m {
                let key = k.as_ptr().add((j0 + jj) * rw);
                let mut acc = [_mm512_setzero_ps(); R];
                for c in 0..parts {
                    let (db, mb, x) = (*key.add(c / B::SUBS)).part(c % B::SUBS);
                    let (x0, x1) = (load16::<B>(x), load16::<B>(x.add(16)));
                    let d = _mm512_set1_ps(f16x(db));
                    let mv = _mm512_set1_ps(if B::HAS_MIN { f16x(mb) } else { 0.0 });
                    for (r, a) in acc.iter_mut().enumerate() {
                        let qp = q.add(r * dh + Q8_0_VALUES * c);
                        let (q0, q1) = (_mm512_loadu_ps(qp), _mm512_loadu_ps(qp.add(16)));
                        let t = _mm512_fmadd_ps(q0, x0, _mm512_mul_ps(q1, x1));
                        *a = _mm512_fmadd_ps(d, t, *a);
                        if B::HAS_MIN {
                            *a = _mm512_fmadd_ps(mv, _mm512_add_ps(q0, q1), *a);
                        }
                    }
                }
                let slot = (jj % 4) * 4 + jj / 4;
                for (t, a) in tmp.iter_mut().zip(acc) {
                    t[slot] = a;
                }
            }
            for (r, t) in tmp.iter().enumerate() {
                let sums = reduce16(t);
                if m == 16 {
                    _mm512_storeu_ps(s.add(r * n + j0), sums);
                } else {
                    // The slots past `m` hold the previous keys' sums: only lanes < m are read.
                    let mut out = [0f32; 16];
                    _mm512_storeu_ps(out.as_mut_ptr(), sums);
                    std::ptr::copy_nonoverlapping(out.as_ptr(), s.add(r * n + j0), m);
                }
            }
            j0 += 16;
        }
    }

    /// `acc (G, Dh) += p (G, n) · v (n rows)` over 8-bit blocks: rows four at a time.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, FMA and F16C.
    #[inline]
    #[target_feature(enable = "avx512f,fma,f16c")]
    pub(crate) unsafe fn accumulate_rows<B: Int8Parts>(
        acc: &mut [f32],
        dh: usize,
        p: &[f32],
        v: &[B],
    ) {
        let g = acc.len() / dh;
        let n = p.len() / g;
        assert!(
            dh % Q8_0_VALUES == 0
                && p.len() == g * n
                && v.len() >= n * (dh / (B::SUBS * Q8_0_VALUES))
        );
        let mut r0 = 0;
        while r0 < g {
            let (ap, pp) = (acc.as_mut_ptr().add(r0 * dh), p.as_ptr().add(r0 * n));
            match g - r0 {
                1 => acc_rows::<B, 1>(ap, dh, pp, n, v),
                2 => acc_rows::<B, 2>(ap, dh, pp, n, v),
                3 => acc_rows::<B, 3>(ap, dh, pp, n, v),
                _ => acc_rows::<B, 4>(ap, dh, pp, n, v),
            }
            r0 += 4;
        }
    }

    /// [`accumulate_rows`] for `R` rows at `a` (`R * Dh` values) with weights at `p + r * n`: a
    /// part's 32 columns of every row in registers across the value rows, each value part
    /// widened once for the `R` rows; offsets `p · m` summed apart and added once.
    #[inline]
    #[target_feature(enable = "avx512f,fma,f16c")]
    unsafe fn acc_rows<B: Int8Parts, const R: usize>(
        a: *mut f32,
        dh: usize,
        p: *const f32,
        n: usize,
        v: &[B],
    ) {
        let parts = dh / Q8_0_VALUES;
        let rw = parts / B::SUBS;
        for c in 0..parts {
            let mut r = [[_mm512_setzero_ps(); 2]; R];
            for (i, ri) in r.iter_mut().enumerate() {
                let ap = a.add(i * dh + Q8_0_VALUES * c);
                *ri = [_mm512_loadu_ps(ap), _mm512_loadu_ps(ap.add(16))];
            }
            let mut off = [0f32; R];
            for j in 0..n {
                let (db, mb, x) = (*v.as_ptr().add(j * rw + c / B::SUBS)).part(c % B::SUBS);
                let (x0, x1) = (load16::<B>(x), load16::<B>(x.add(16)));
                let d = f16x(db);
                let m = if B::HAS_MIN { f16x(mb) } else { 0.0 };
                for (i, ri) in r.iter_mut().enumerate() {
                    let pj = *p.add(i * n + j);
                    let w = _mm512_set1_ps(pj * d);
                    ri[0] = _mm512_fmadd_ps(w, x0, ri[0]);
                    ri[1] = _mm512_fmadd_ps(w, x1, ri[1]);
                    if B::HAS_MIN {
                        off[i] = pj.mul_add(m, off[i]);
                    }
                }
            }
            for (i, ri) in r.iter().enumerate() {
                let ap = a.add(i * dh + Q8_0_VALUES * c);
                let o = _mm512_set1_ps(off[i]);
                _mm512_storeu_ps(ap, _mm512_add_ps(ri[0], o));
                _mm512_storeu_ps(ap.add(16), _mm512_add_ps(ri[1], o));
            }
        }
    }
}
