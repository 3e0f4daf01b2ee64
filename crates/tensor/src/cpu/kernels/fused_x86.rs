//! Fused decode + dot for one activation row (decode, T = 1) on AVX-512 VNNI, for ggml's
//! 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): two blocks per 512-bit step, decoded in
//! registers straight from the mapped bytes and dotted with `vpdpbusd`, no scratch. At T = 1 the
//! decode is the whole cost (each block is used once), so skipping the store and reload of the
//! generic path (`unpack.rs` + `dot_x86.rs`) is what brings the matvec toward memory speed.
//!
//! Same arithmetic as the generic engines: codes `u` (unsigned), per block `a * u + c`,
//! `out = Σ_b (a_b * dx_b) * Σ u * q + Σ_b c_b * sx_b` (`sx_b = dx_b * Σ q` over the block).
//!
//! Not here: k-quants and MLX at T = 1 (generic path), AVX2 fused kernels.

use std::arch::x86_64::*;

use super::q8act::ActQ8;
use super::unpack::WView;
use crate::GgmlType;

use super::legacy::{block_bytes, qs_at, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};

/// Rows `r0..r1` of `w` against the single activation row of `act` (`split`: the two rows of a
/// two-part activation, summed), into `out[r]`. Returns false (doing nothing) when the weight
/// is not one of the fused formats.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL/VNNI; `act` must hold one row of `w.cols` values; `out`
/// must cover index `r1 - 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn matvec_avx512(
    w: &WView<'_>,
    r0: usize,
    r1: usize,
    act: &ActQ8,
    split: bool,
    out: *mut f32,
) -> bool {
    let WView::Ggml {
        ty,
        data,
        row_bytes,
    } = *w
    else {
        return false;
    };
    let p = data.as_ptr();
    match ty {
        GgmlType::Q4_0 => rows::<Q4_0>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::Q4_1 => rows::<Q4_1>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::Q5_0 => rows::<Q5_0>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::Q5_1 => rows::<Q5_1>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::Q8_0 => rows::<Q8_0>(p, row_bytes, r0, r1, act, split, out),
        _ => return false,
    }
    true
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows<const F: u8>(
    p: *const u8,
    row_bytes: usize,
    r0: usize,
    r1: usize,
    act: &ActQ8,
    split: bool,
    out: *mut f32,
) {
    let nb = act.k / 32;
    for r in r0..r1 {
        let pr = p.add(r * row_bytes);
        *out.add(r) = if split {
            row::<F, true>(pr, nb, act)
        } else {
            row::<F, false>(pr, nb, act)
        };
    }
}

/// The f16 at `p` as f32 (F16C).
#[inline]
#[target_feature(enable = "f16c")]
unsafe fn half(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// The 64 codes of the blocks at `p0` and `p1`, in element order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn codes2<const F: u8>(p0: *const u8, p1: *const u8) -> __m512i {
    if F == Q8_0 {
        let a = _mm256_loadu_si256(p0.add(2) as *const __m256i);
        let b = _mm256_loadu_si256(p1.add(2) as *const __m256i);
        return _mm512_xor_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1),
            _mm512_set1_epi8(-128),
        );
    }
    let qs = qs_at(F);
    let a = _mm_loadu_si128(p0.add(qs) as *const __m128i);
    let b = _mm_loadu_si128(p1.add(qs) as *const __m128i);
    let ab = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    // 128-bit lanes [a, a, b, b]; lanes 1 and 3 shifted down a nibble: [lo a, hi a, lo b, hi b],
    // which is element order (byte j holds elements j and j + 16).
    let z = _mm512_permutexvar_epi64(
        _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0),
        _mm512_castsi256_si512(ab),
    );
    let z = _mm512_and_si512(
        _mm512_mask_srli_epi16(z, 0xff00_ff00, z, 4),
        _mm512_set1_epi8(0x0f),
    );
    if F == Q5_0 || F == Q5_1 {
        // qh bit j is the fifth bit of element j.
        let h = if F == Q5_0 { 2 } else { 4 };
        let h0 = (p0.add(h) as *const u32).read_unaligned() as u64;
        let h1 = (p1.add(h) as *const u32).read_unaligned() as u64;
        return _mm512_mask_add_epi8(z, h0 | (h1 << 32), z, _mm512_set1_epi8(16));
    }
    z
}

/// The offset `c` of the block at `p` whose scale is `d`.
#[inline]
#[target_feature(enable = "f16c")]
unsafe fn offset<const F: u8>(p: *const u8, d: f32) -> f32 {
    match F {
        Q4_0 => -8.0 * d,
        Q5_0 => -16.0 * d,
        Q8_0 => -128.0 * d,
        _ => half(p.add(2)),
    }
}

/// One row's dot with the activation row (`SPLIT`: with the two-part activation, whose second
/// part is row 1 of `act` at scale `dx / 256`; the two integer dots combine exactly as
/// `256 * hi + lo`, at most 4 * 255 * 127 * 257 < 2^31 per lane).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn row<const F: u8, const SPLIT: bool>(p: *const u8, nb: usize, act: &ActQ8) -> f32 {
    let bs = block_bytes(F);
    let (qx, dx, sx) = (act.qx.as_ptr(), act.dx.as_ptr(), act.sx32.as_ptr());
    let (k, g) = (act.k, act.k / 16);
    // With SPLIT the scale is the second part's (dx / 256, exact in f32).
    let dsc = if SPLIT { dx.add(g) } else { dx };
    let mut acc = _mm512_setzero_ps();
    let mut off = 0f32;
    let mut b = 0;
    let sxb = |b: usize| {
        if SPLIT {
            *sx.add(b) + *sx.add(nb + b)
        } else {
            *sx.add(b)
        }
    };
    while b + 2 <= nb {
        let (p0, p1) = (p.add(b * bs), p.add((b + 1) * bs));
        let z = codes2::<F>(p0, p1);
        let x = _mm512_loadu_si512(qx.add(32 * b) as *const __m512i);
        let mut dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, x);
        if SPLIT {
            let xl = _mm512_loadu_si512(qx.add(k + 32 * b) as *const __m512i);
            let lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, xl);
            dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), lo);
        }
        let (d0, d1) = (half(p0), half(p1));
        let s = _mm512_mask_blend_ps(
            0xff00,
            _mm512_set1_ps(d0 * *dsc.add(2 * b)),
            _mm512_set1_ps(d1 * *dsc.add(2 * b + 2)),
        );
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc);
        off += offset::<F>(p0, d0) * sxb(b) + offset::<F>(p1, d1) * sxb(b + 1);
        b += 2;
    }
    if b < nb {
        // One block left: decode it twice, and let the zeroed upper activations drop the copy.
        let p0 = p.add(b * bs);
        let z = codes2::<F>(p0, p0);
        let x = _mm512_maskz_loadu_epi8(0xffff_ffff, qx.add(32 * b));
        let mut dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, x);
        if SPLIT {
            let xl = _mm512_maskz_loadu_epi8(0xffff_ffff, qx.add(k + 32 * b));
            let lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, xl);
            dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), lo);
        }
        let d0 = half(p0);
        acc = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(dot),
            _mm512_set1_ps(d0 * *dsc.add(2 * b)),
            acc,
        );
        off += offset::<F>(p0, d0) * sxb(b);
    }
    _mm512_reduce_add_ps(acc) + off
}
