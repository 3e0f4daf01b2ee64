//! Grouped kernels for blocks of 8-bit parts on AVX-512: each key's integers widened once, the
//! `G` query rows' 16-lane sums kept apart and reduced sixteen keys at a time by a transposing
//! tree instead of one horizontal sum per key (`super`'s header says where they are used).

use std::arch::x86_64::*;

use super::int8::{f16x, Int8Parts};
use hf2q_tensor::kv::Q8_0_VALUES;

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
