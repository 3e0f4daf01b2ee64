//! Fused decode + dot for one activation row (decode, T = 1) on AVX-512 VNNI, for ggml's
//! 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4): two blocks per 512-bit step, decoded in
//! registers straight from the mapped bytes and dotted with `vpdpbusd`, no scratch. At T = 1 the
//! decode is the whole cost (each block is used once), so skipping the store and reload of the
//! generic path (`unpack.rs` + `dot_x86.rs`) is what brings the matvec toward memory speed.
//!
//! Same arithmetic as the generic engines: codes `u` (unsigned), per block `a * u + c`,
//! `out = Σ_b (a_b * dx_b) * Σ u * q + Σ_b c_b * sx_b` (`sx_b = dx_b * Σ q` over the block).
//!
//! MXFP4 is Q4_0's nibbles through a byte shuffle of its code table and an E8M0 scale
//! (`mxfp4.rs`): `a = 2^(e - 128)`, `c = -12a`.
//!
//! Q4_K and Q6_K (256-element super-blocks) the same way: 64 codes per step, their scales per
//! super-block in one vector, spread over the dot's lanes by a permute.
//!
//! Not here: the other k-quants and MLX at T = 1 (generic path), AVX2 fused kernels.

use std::arch::x86_64::*;

use super::q8act::ActQ8;
use super::unpack::WView;
use hf2q_tensor::GgmlType;

use super::legacy::{block_bytes, qs_at, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::mxfp4;

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
    let (ty, data, row_bytes) = match *w {
        WView::Ggml {
            ty,
            data,
            row_bytes,
        } => (ty, data, row_bytes),
        WView::Packed { data, nb, fmt } => {
            super::packed::x86::matvec(data.as_ptr(), nb, fmt, r0, r1, act, split, out);
            return true;
        }
        WView::Affine { .. } => return false,
    };
    let p = data.as_ptr();
    match ty {
        GgmlType::Q4_0 => rows::<Q4_0>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::Q4_1 => rows::<Q4_1>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::Q5_0 => rows::<Q5_0>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::Q5_1 => rows::<Q5_1>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::Q8_0 => rows::<Q8_0>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::MXFP4 => rows::<MXFP4>(p, row_bytes, r0, r1, act, split, out),
        GgmlType::Q4_K | GgmlType::Q6_K => {
            let q4 = ty == GgmlType::Q4_K;
            for r in r0..r1 {
                let pr = p.add(r * row_bytes);
                *out.add(r) = match (q4, split) {
                    (true, true) => row_q4_k::<true>(pr, act),
                    (true, false) => row_q4_k::<false>(pr, act),
                    (false, true) => row_q6_k::<true>(pr, act),
                    (false, false) => row_q6_k::<false>(pr, act),
                };
            }
        }
        _ => return false,
    }
    true
}

/// How far ahead (bytes) the T = 1 kernels prefetch the weight rows into L1, for the formats
/// whose decode is the bound (4 and 5 bits).
const PREFETCH: usize = 4096;

/// How far ahead (bytes) Q8_0, bound by memory bandwidth, prefetches into L2 (measured: this
/// takes 12 % off a decode step that L1 prefetches do not improve; L2 has more misses in flight).
const PREFETCH_L2: usize = 8192;

/// Software prefetch for the pair of blocks at `p0`: the hardware prefetchers alone leave a
/// matrix streamed from memory at two thirds of the speed.
#[inline(always)]
unsafe fn prefetch<const F: u8>(p0: *const u8) {
    if F == Q8_0 {
        // A pair spans more than a line: two, so that no line is skipped.
        _mm_prefetch::<_MM_HINT_T1>(p0.wrapping_add(PREFETCH_L2) as *const i8);
        _mm_prefetch::<_MM_HINT_T1>(p0.wrapping_add(PREFETCH_L2 + 64) as *const i8);
    } else {
        _mm_prefetch::<_MM_HINT_T0>(p0.wrapping_add(PREFETCH) as *const i8);
    }
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
    // One row at a time: rows side by side (sharing the activation loads) touch the lines of
    // a page out of order, which the hardware prefetchers do not follow; streaming a large
    // matrix from memory ran at half the speed with four rows, 1.4x slower with two.
    for r in r0..r1 {
        let pr = p.add(r * row_bytes);
        *out.add(r) = if split {
            row::<F, true>(pr, act)
        } else {
            row::<F, false>(pr, act)
        };
    }
}

/// The 64 codes of the blocks at `p0` and `p1`, in element order (`lut`: MXFP4's code table,
/// `mxfp4::x86::lut`; unused by the other formats).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn codes2<const F: u8>(p0: *const u8, p1: *const u8, lut: __m512i) -> __m512i {
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
    if F == MXFP4 {
        return mxfp4::x86::lookup(lut, z);
    }
    z
}

/// Lane indices of a 16-lane dot vector, for four steps: lane `l` of step `j` takes scale
/// `per_step * j + l / lanes` (each scale covers `lanes` consecutive lanes).
const fn lane_scales(per_step: usize, lanes: usize) -> [[u32; 16]; 4] {
    let mut t = [[0u32; 16]; 4];
    let mut j = 0;
    while j < 4 {
        let mut l = 0;
        while l < 16 {
            t[j][l] = (per_step * j + l / lanes) as u32;
            l += 1;
        }
        j += 1;
    }
    t
}

/// Lane indices that spread the scales of blocks `2j` and `2j + 1` (of an 8-block chunk) over
/// the two halves of a pair's dot vector.
static PAIR_IDX: [[u32; 16]; 4] = lane_scales(2, 8);

/// The activation scales and offset sums a fused row reads: per 32-element block (`per16`
/// false) or per 16 elements. With `SPLIT` the scales are the second part's (row 1 of `act`,
/// in whose units the combined integer dot is) and the sums both parts'.
fn act_scales<const SPLIT: bool>(act: &ActQ8, per16: bool) -> (*const f32, *const f32) {
    let (dx, sx, sxp, n) = if per16 {
        (&act.dx, &act.sx, &act.sxp, act.k / 16)
    } else {
        (&act.dx32, &act.sx32, &act.sxp32, act.k / 32)
    };
    if SPLIT {
        // SAFETY: the second part's row starts n values in (the buffers hold both rows).
        (unsafe { dx.as_ptr().add(n) }, sxp.as_ptr())
    } else {
        (dx.as_ptr(), sx.as_ptr())
    }
}

/// The integer dot of 64 codes `z` with the activations at `qx + e` (`SPLIT`: and with the
/// second part at `qx + k + e`, combined as `256 * hi + lo`); `LOW`: only the low 32 codes'
/// activations are read (the last, odd block of a row), the upper lanes get zeros.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn dot64<const SPLIT: bool, const LOW: bool>(
    z: __m512i,
    qx: *const i8,
    e: usize,
    k: usize,
) -> __m512i {
    let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, load_act::<LOW>(qx.add(e)));
    if !SPLIT {
        return dot;
    }
    _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 8), z, load_act::<LOW>(qx.add(k + e)))
}

/// 64 activation bytes at `p` (`LOW`: only 32, zeros above). A function of its own, not a
/// closure: a closure would be compiled without the caller's target features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn load_act<const LOW: bool>(p: *const i8) -> __m512i {
    if LOW {
        _mm512_maskz_loadu_epi8(0xffff_ffff, p)
    } else {
        _mm512_loadu_si512(p as *const __m512i)
    }
}

/// One row's dot with the activation row (`SPLIT`: with the two-part activation, whose second
/// part is row 1 of `act` at scale `dx / 256`; the two integer dots combine exactly as
/// `256 * hi + lo`, at most 4 * 255 * 127 * 257 < 2^31 per lane).
///
/// Blocks go in chunks of 8: the chunk's block scales `d` are collected into one vector and
/// multiplied by the activation scales once (`a * dx` per block), the offsets `c * sx` are one
/// multiply-add per chunk, and each pair of blocks then costs its decode, the integer dot, and
/// one convert, permute (spreading the pair's two scales) and multiply-add. The float
/// reduction happens once, at the end.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn row<const F: u8, const SPLIT: bool>(p: *const u8, act: &ActQ8) -> f32 {
    let bs = block_bytes(F);
    let (k, nb) = (act.k, act.k / 32);
    let qx = act.qx.as_ptr();
    let (dxs, sxs) = act_scales::<SPLIT>(act, false);
    let mut acc = _mm512_setzero_ps();
    let mut off = _mm256_setzero_ps();
    let (lut, kmin) = if F == MXFP4 {
        (mxfp4::x86::lut(), mxfp4::tables().kmin)
    } else {
        (_mm512_setzero_si512(), offset_k(F))
    };
    let mut c0 = 0;
    while c0 < nb {
        let nc = 8.min(nb - c0);
        let m8: __mmask8 = if nc == 8 { 0xff } else { (1u8 << nc) - 1 };
        let base = p.add(c0 * bs);
        let d = if F == MXFP4 {
            mxfp4::x86::half_scales8(base, bs, nc)
        } else {
            halves8(base, bs, nc)
        };
        let sc = _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_maskz_loadu_ps(m8, dxs.add(c0))));
        let c = match F {
            Q4_1 | Q5_1 => halves8(base.add(2), bs, nc),
            _ => _mm256_mul_ps(d, _mm256_set1_ps(kmin)),
        };
        off = _mm256_fmadd_ps(c, _mm256_maskz_loadu_ps(m8, sxs.add(c0)), off);
        let mut j = 0;
        while j + 2 <= nc {
            let b = c0 + j;
            let p0 = p.add(b * bs);
            prefetch::<F>(p0);
            let z = codes2::<F>(p0, p0.add(bs), lut);
            let dot = dot64::<SPLIT, false>(z, qx, 32 * b, k);
            let idx = _mm512_loadu_si512(PAIR_IDX[j / 2].as_ptr() as *const __m512i);
            let s = _mm512_permutexvar_ps(idx, sc);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc);
            j += 2;
        }
        if j < nc {
            // One block left: decode it twice, and let the zeroed upper activations drop the
            // copy (its lanes take the same scale, times a zero dot).
            let b = c0 + j;
            let p0 = p.add(b * bs);
            let z = codes2::<F>(p0, p0, lut);
            let dot = dot64::<SPLIT, true>(z, qx, 32 * b, k);
            let s = _mm512_permutexvar_ps(_mm512_set1_epi32(j as i32), sc);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc);
        }
        c0 += nc;
    }
    // The offsets in the low half of a zeroed vector: one reduction for both sums.
    _mm512_reduce_add_ps(_mm512_add_ps(acc, _mm512_zextps256_ps512(off)))
}

/// The f16 at the start of each of `n` (at most 8) blocks `bs` apart from `base`, as f32 (zeros
/// beyond `n`). Inserted one by one from scalar loads: a vector gather is microcoded on some
/// cores and waits on the first touch of these cache lines (three times slower end to end).
#[inline(always)]
unsafe fn halves8(base: *const u8, bs: usize, n: usize) -> __m256 {
    let ld = |l: usize| (base.add(l * bs) as *const u16).read_unaligned() as i32;
    let mut h = _mm_setzero_si128();
    macro_rules! put {
        ($($l:literal),*) => {
            if n == 8 {
                $(h = _mm_insert_epi16::<$l>(h, ld($l));)*
            } else {
                $(if $l < n {
                    h = _mm_insert_epi16::<$l>(h, ld($l));
                })*
            }
        };
    }
    put!(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cvtph_ps(h)
}

/// The offset of a block as a multiple of its scale (`c = K * d`), for the formats without a
/// stored minimum.
const fn offset_k(f: u8) -> f32 {
    match f {
        Q4_0 => -8.0,
        Q5_0 => -16.0,
        _ => -128.0,
    }
}

/// The f16 at `p` as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,f16c")]
unsafe fn half(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// A Q4_K super-block's eight 6-bit scales and eight 6-bit minimums (`get_scale_min_k4` of
/// `quant/kquants.rs` for j = 0..8, four at a time in 32-bit words), as bytes of two u64.
#[inline(always)]
unsafe fn q4_k_scales(q: *const u8) -> (u64, u64) {
    let w = |i: usize| (q.add(4 * i) as *const u32).read_unaligned();
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LO6: u32 = 0x3f3f_3f3f;
    const LO4: u32 = 0x0f0f_0f0f;
    const LO2: u32 = 0x0303_0303;
    let sc_lo = w0 & LO6;
    let m_lo = w1 & LO6;
    let sc_hi = (w2 & LO4) | (((w0 >> 6) & LO2) << 4);
    let m_hi = ((w2 >> 4) & LO4) | (((w1 >> 6) & LO2) << 4);
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        m_lo as u64 | (m_hi as u64) << 32,
    )
}

/// Eight bytes of a u64 as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2")]
unsafe fn bytes8_f32(v: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
}

/// One Q4_K row (144-byte super-blocks: `d`, `dmin`, 12 bytes of scales, 128 bytes of
/// nibbles) dotted with the activation row; `SPLIT` as in [`row`]. Each 32-element sub-block
/// is an activation block, so the per-32 activation scales and sums apply unchanged:
/// `a = d * sc`, `c = -dmin * m`. Each 32 bytes of nibbles are 64 codes (low nibbles the first
/// sub-block, high nibbles the second), one `vpdpbusd` step.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn row_q4_k<const SPLIT: bool>(p: *const u8, act: &ActQ8) -> f32 {
    let k = act.k;
    let qx = act.qx.as_ptr();
    let (dxs, sxs) = act_scales::<SPLIT>(act, false);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = _mm512_setzero_ps();
    let mut off = _mm256_setzero_ps();
    for sb in 0..k / 256 {
        let b = p.add(sb * 144);
        let (d, dmin) = (half(b), half(b.add(2)));
        let (sc, m) = q4_k_scales(b.add(4));
        let a = _mm256_mul_ps(_mm256_set1_ps(d), bytes8_f32(sc));
        let s = _mm512_castps256_ps512(_mm256_mul_ps(a, _mm256_loadu_ps(dxs.add(8 * sb))));
        let c = _mm256_mul_ps(_mm256_set1_ps(-dmin), bytes8_f32(m));
        off = _mm256_fmadd_ps(c, _mm256_loadu_ps(sxs.add(8 * sb)), off);
        for (ch, idx) in PAIR_IDX.iter().enumerate() {
            let q = b.add(16 + 32 * ch);
            _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(PREFETCH) as *const i8);
            let y = _mm256_loadu_si256(q as *const __m256i);
            let z = _mm512_and_si512(
                _mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1),
                m4,
            );
            let dot = dot64::<SPLIT, false>(z, qx, 256 * sb + 64 * ch, k);
            let idx = _mm512_loadu_si512(idx.as_ptr() as *const __m512i);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, s), acc);
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc, _mm512_zextps256_ps512(off)))
}

/// Lane indices spreading a Q6_K super-block's 16 sub-block scales over the dot lanes of its
/// four 64-element steps: step `st` covers sub-blocks `4 st ..= 4 st + 3`, four lanes each.
static Q6K_IDX: [[u32; 16]; 4] = lane_scales(4, 4);

/// One Q6_K row (210-byte super-blocks: 128 bytes of low nibbles, 64 of high bit pairs, 16
/// signed scales, `d`) dotted with the activation row; `SPLIT` as in [`row`]. Codes are the
/// unsigned 6-bit `u` (weight `a * (u - 32)`, `a = d * sc` per 16 elements), so per 16 elements
/// the per-16 activation scales and sums apply: `c = -32 a`. A 128-element half is two steps
/// of 64 codes, built from 32 bytes of each nibble half and the 32 bytes of bit pairs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn row_q6_k<const SPLIT: bool>(p: *const u8, act: &ActQ8) -> f32 {
    let k = act.k;
    let qx = act.qx.as_ptr();
    let (dxs, sxs) = act_scales::<SPLIT>(act, true);
    let (m4, m30) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
    let mut acc = _mm512_setzero_ps();
    let mut off = _mm512_setzero_ps();
    for sb in 0..k / 256 {
        let b = p.add(sb * 210);
        let d = half(b.add(208));
        let scales = _mm_loadu_si128(b.add(192) as *const __m128i);
        let a = _mm512_mul_ps(
            _mm512_set1_ps(d),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales)),
        );
        let s = _mm512_mul_ps(a, _mm512_loadu_ps(dxs.add(16 * sb)));
        off = _mm512_fmadd_ps(
            _mm512_mul_ps(a, _mm512_set1_ps(-32.0)),
            _mm512_loadu_ps(sxs.add(16 * sb)),
            off,
        );
        for n in 0..2 {
            let (ql, qh) = (b.add(64 * n), b.add(128 + 32 * n));
            _mm_prefetch::<_MM_HINT_T0>(ql.wrapping_add(PREFETCH) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(qh.wrapping_add(PREFETCH) as *const i8);
            let q0 = _mm256_loadu_si256(ql as *const __m256i);
            let q1 = _mm256_loadu_si256(ql.add(32) as *const __m256i);
            let h = _mm256_loadu_si256(qh as *const __m256i);
            // Bytes: q = [ql 0..32 | ql 32..64], hh = [qh | qh >> 2]; elements 0..64 of the
            // half take the low nibbles and bit pair (0, 1) / (2, 3), elements 64..128 the
            // high nibbles and bit pair (4, 5) / (6, 7). The 16-bit shifts move bits across
            // bytes only where the masks drop them.
            let q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
            let hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
            let za = _mm512_or_si512(
                _mm512_and_si512(q, m4),
                _mm512_and_si512(_mm512_slli_epi16(hh, 4), m30),
            );
            let zb = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                _mm512_and_si512(hh, m30),
            );
            for (st, z) in [(2 * n, za), (2 * n + 1, zb)] {
                let dot = dot64::<SPLIT, false>(z, qx, 256 * sb + 64 * st, k);
                let idx = _mm512_loadu_si512(Q6K_IDX[st].as_ptr() as *const __m512i);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, s), acc);
            }
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc, off))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::q8act::{self, ActQ8};
    use crate::kernels::Isa;
    use hf2q_tensor::quant::float::f32_to_f16_bits;
    use hf2q_tensor::{Bytes, QTensor};

    struct Rng(u64);
    impl Rng {
        fn u64(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn f(&mut self) -> f32 {
            ((self.u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        }
    }

    /// Random blocks of `ty`: random bytes (every code, scale and high-bit pattern), with the
    /// f16 scales (and minimums) set to small finite values of either sign.
    fn random_weight(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> QTensor {
        let ts = ty.type_size();
        let n = ty.row_bytes(cols).unwrap() * rows;
        let mut b: Vec<u8> = (0..n).map(|_| rng.u64() as u8).collect();
        for blk in b.chunks_mut(ts) {
            let mut put = |at: usize, v: f32| {
                blk[at..at + 2].copy_from_slice(&f32_to_f16_bits(v).to_le_bytes())
            };
            let (d, m) = (0.01 * rng.f(), 0.01 * rng.f());
            match ty {
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K => {
                    put(0, d);
                    put(2, m);
                }
                GgmlType::Q6_K => put(208, d),
                _ => put(0, d),
            }
        }
        QTensor::ggml("w", ty, rows, cols, Bytes::from_vec(b)).unwrap()
    }

    /// Every fused format against an exact (f64) product of the reference dequantizer's rows
    /// with the quantized activations, for every block count up to 20 (chunks of 8 with and
    /// without an odd last block), a few rows, and both activation forms. Allowed: f32
    /// rounding only, as in the kernel contract tests: about one rounding per 16-element partial
    /// sum and scale product, `(1e-5 + C/16 * 2^-22) * Σ |w| |x|`.
    #[test]
    fn fused_matvec_matches_exact_product() {
        if !Isa::Avx512Vnni.is_available() {
            eprintln!("skipped: no AVX-512 VNNI");
            return;
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let types = [
            (GgmlType::Q4_0, 32),
            (GgmlType::Q4_1, 32),
            (GgmlType::Q5_0, 32),
            (GgmlType::Q5_1, 32),
            (GgmlType::Q8_0, 32),
            (GgmlType::Q4_K, 256),
            (GgmlType::Q6_K, 256),
        ];
        let mut checked = 0;
        for (ty, blk) in types {
            let max_blocks = if blk == 32 { 20 } else { 3 };
            for nb in 1..=max_blocks {
                let k = blk * nb;
                for rows in [1, 3, 5] {
                    let w = random_weight(ty, rows, k, &mut rng);
                    let wv = WView::new(&w).unwrap();
                    let x: Vec<f32> = (0..k).map(|_| rng.f() * 2.0).collect();
                    for split in [false, true] {
                        let mut act = ActQ8::default();
                        // SAFETY: the portable quantizers run everywhere.
                        let xq: Vec<f64> = unsafe {
                            if split {
                                act.reshape(2, k);
                                q8act::quantize_rows_split(
                                    &x,
                                    &mut act,
                                    q8act::quantize_row_split_scalar,
                                );
                                (0..k)
                                    .map(|i| {
                                        act.dx[i / 16] as f64 * act.qx[i] as f64
                                            + act.dx[k / 16 + i / 16] as f64 * act.qx[k + i] as f64
                                    })
                                    .collect()
                            } else {
                                act.reshape(1, k);
                                q8act::quantize_rows(&x, &mut act, q8act::quantize_row_scalar);
                                (0..k)
                                    .map(|i| act.dx[i / 16] as f64 * act.qx[i] as f64)
                                    .collect()
                            }
                        };
                        let mut out = vec![f32::NAN; rows];
                        // SAFETY: AVX-512 VNNI checked above; one activation row of k values;
                        // out holds `rows` values.
                        let done =
                            unsafe { matvec_avx512(&wv, 0, rows, &act, split, out.as_mut_ptr()) };
                        assert!(done, "{ty} is a fused format");
                        let mut wr = vec![0f32; k];
                        for (r, &got) in out.iter().enumerate() {
                            w.dequantize_row(r, &mut wr).unwrap();
                            let exact: f64 = wr.iter().zip(&xq).map(|(a, b)| *a as f64 * b).sum();
                            let l1: f64 =
                                wr.iter().zip(&xq).map(|(a, b)| (*a as f64 * b).abs()).sum();
                            let tol = (1e-5 + (k / 16) as f64 * 2f64.powi(-22)) * l1 + 1e-30;
                            assert!(
                                (got as f64 - exact).abs() <= tol,
                                "{ty} {rows}x{k} split={split} row {r}: {got} vs {exact} (tol {tol})"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 500);
    }

    /// Formats without a fused kernel are declined, untouched.
    #[test]
    fn other_formats_are_declined() {
        if !Isa::Avx512Vnni.is_available() {
            return;
        }
        let mut rng = Rng(7);
        let w = random_weight(GgmlType::Q2_K, 2, 256, &mut rng);
        let mut act = ActQ8::default();
        act.reshape(1, 256);
        let mut out = [1.5f32; 2];
        // SAFETY: AVX-512 VNNI checked above.
        let done = unsafe {
            matvec_avx512(
                &WView::new(&w).unwrap(),
                0,
                2,
                &act,
                false,
                out.as_mut_ptr(),
            )
        };
        assert!(!done && out == [1.5, 1.5]);
    }
}
