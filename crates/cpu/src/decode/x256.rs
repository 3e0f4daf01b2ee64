//! Grouped kernels for blocks of 8-bit parts on AVX2: [`super::x512`]'s structure on
//! 8-lane vectors (a 32-value part is four), the `G` rows' sums reduced eight keys at a time.

use std::arch::x86_64::*;

use super::int8::{f16x, Int8Parts};
use hf2q_tensor::kv::Q8_0_VALUES;

/// 8 integers from `p` widened to f32.
///
/// # Safety
/// The CPU must have AVX2; `p..p+8` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load8<B: Int8Parts>(p: *const u8) -> __m256 {
    let x = _mm_loadl_epi64(p as *const __m128i);
    _mm256_cvtepi32_ps(if B::SIGNED {
        _mm256_cvtepi8_epi32(x)
    } else {
        _mm256_cvtepu8_epi32(x)
    })
}

/// A part's 32 integers at `p` widened to f32, four vectors of 8.
///
/// # Safety
/// The CPU must have AVX2; `p..p+32` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load32<B: Int8Parts>(p: *const u8) -> [__m256; 4] {
    [
        load8::<B>(p),
        load8::<B>(p.add(8)),
        load8::<B>(p.add(16)),
        load8::<B>(p.add(24)),
    ]
}

/// The sums of eight vectors, one per lane: lane `j` is the sum of `v[j]`'s lanes. Pairwise
/// horizontal adds within 128-bit halves (four sums of `v[0..4]`, four of `v[4..8]`, per
/// half), then the two halves added: 9 operations for 8 sums.
///
/// # Safety
/// The CPU must have AVX.
#[inline]
#[target_feature(enable = "avx")]
unsafe fn reduce8(v: &[__m256; 8]) -> __m256 {
    let (a, b) = (_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    let (c, d) = (_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    // Per half: lanes 0..4 are v[0..4]'s (x) and v[4..8]'s (y) partial sums.
    let (x, y) = (_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(x, y),
        _mm256_permute2f128_ps::<0x31>(x, y),
    )
}

/// `s (G, n) = q (G, Dh) · k (n keys)ᵀ` over 8-bit blocks: rows four at a time.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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

/// [`scores`] for `R` rows at `q` (`R * Dh` values), into `s + r * n`. With a bias, each
/// row's part sums `Σ_i q[32c + i]` (8 lanes) are made once, not once per key.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn score_rows<B: Int8Parts, const R: usize>(
    q: *const f32,
    dh: usize,
    k: &[B],
    n: usize,
    s: *mut f32,
) {
    let parts = dh / Q8_0_VALUES;
    let rw = parts / B::SUBS;
    // qsum (R, parts), lane sums of each row's parts: empty without a bias. A plain loop:
    // a closure is compiled without this function's features.
    let mut qsum: Vec<__m256> = Vec::new();
    if B::HAS_MIN {
        for i in 0..R * parts {
            let qp = q.add((i / parts) * dh + Q8_0_VALUES * (i % parts));
            let lo = _mm256_add_ps(_mm256_loadu_ps(qp), _mm256_loadu_ps(qp.add(8)));
            let hi = _mm256_add_ps(_mm256_loadu_ps(qp.add(16)), _mm256_loadu_ps(qp.add(24)));
            qsum.push(_mm256_add_ps(lo, hi));
        }
    }
    let mut tmp = [[_mm256_setzero_ps(); 8]; R];
    let mut j0 = 0;
    while j0 < n {
        let m = (n - j0).min(8);
        for jj in 0..m {
            let key = k.as_ptr().add((j0 + jj) * rw);
            let mut acc = [_mm256_setzero_ps(); R];
            for c in 0..parts {
                let (db, mb, x) = (*key.add(c / B::SUBS)).part(c % B::SUBS);
                let x = load32::<B>(x);
                let d = _mm256_set1_ps(f16x(db));
                let mv = _mm256_set1_ps(if B::HAS_MIN { f16x(mb) } else { 0.0 });
                for (r, a) in acc.iter_mut().enumerate() {
                    let qp = q.add(r * dh + Q8_0_VALUES * c);
                    let t = _mm256_mul_ps(_mm256_loadu_ps(qp), x[0]);
                    let t = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8)), x[1], t);
                    let t = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(16)), x[2], t);
                    let t = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(24)), x[3], t);
                    *a = _mm256_fmadd_ps(d, t, *a);
                    if B::HAS_MIN {
                        *a = _mm256_fmadd_ps(mv, qsum[r * parts + c], *a);
                    }
                }
            }
            for (t, a) in tmp.iter_mut().zip(acc) {
                t[jj] = a;
            }
        }
        for (r, t) in tmp.iter().enumerate() {
            let sums = reduce8(t);
            if m == 8 {
                _mm256_storeu_ps(s.add(r * n + j0), sums);
            } else {
                // The slots past `m` hold the previous keys' sums: only lanes < m are read.
                let mut out = [0f32; 8];
                _mm256_storeu_ps(out.as_mut_ptr(), sums);
                std::ptr::copy_nonoverlapping(out.as_ptr(), s.add(r * n + j0), m);
            }
        }
        j0 += 8;
    }
}

/// `acc (G, Dh) += p (G, n) · v (n rows)` over 8-bit blocks: rows four at a time.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn accumulate_rows<B: Int8Parts>(acc: &mut [f32], dh: usize, p: &[f32], v: &[B]) {
    let g = acc.len() / dh;
    let n = p.len() / g;
    assert!(
        dh % Q8_0_VALUES == 0 && p.len() == g * n && v.len() >= n * (dh / (B::SUBS * Q8_0_VALUES))
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

/// [`accumulate_rows`] for `R` rows at `a` (`R * Dh` values) with weights at `p + r * n`:
/// half a part (16 columns) of every row in registers across the value rows (a whole part
/// of four rows would take all sixteen registers), each half widened once for the `R` rows;
/// offsets `p · m` summed apart in the first half and added to both.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
        let mut off = [0f32; R];
        for half in 0..2 {
            let col = Q8_0_VALUES * c + 16 * half;
            let mut r = [[_mm256_setzero_ps(); 2]; R];
            for (i, ri) in r.iter_mut().enumerate() {
                let ap = a.add(i * dh + col);
                *ri = [_mm256_loadu_ps(ap), _mm256_loadu_ps(ap.add(8))];
            }
            for j in 0..n {
                let (db, mb, x) = (*v.as_ptr().add(j * rw + c / B::SUBS)).part(c % B::SUBS);
                let x = x.add(16 * half);
                let (x0, x1) = (load8::<B>(x), load8::<B>(x.add(8)));
                let d = f16x(db);
                let m = if B::HAS_MIN && half == 0 {
                    f16x(mb)
                } else {
                    0.0
                };
                for (i, ri) in r.iter_mut().enumerate() {
                    let pj = *p.add(i * n + j);
                    let w = _mm256_set1_ps(pj * d);
                    ri[0] = _mm256_fmadd_ps(w, x0, ri[0]);
                    ri[1] = _mm256_fmadd_ps(w, x1, ri[1]);
                    if B::HAS_MIN && half == 0 {
                        off[i] = pj.mul_add(m, off[i]);
                    }
                }
            }
            for (i, ri) in r.iter().enumerate() {
                let ap = a.add(i * dh + col);
                let o = _mm256_set1_ps(off[i]);
                _mm256_storeu_ps(ap, _mm256_add_ps(ri[0], o));
                _mm256_storeu_ps(ap.add(8), _mm256_add_ps(ri[1], o));
            }
        }
    }
}
