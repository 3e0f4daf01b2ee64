//! x86-64 engines for float weights (F32, F16, BF16) against f32 activations: rows converted to
//! f32 on the fly (F16 with `vcvtph2ps`, BF16 by a 16-bit shift) and multiplied with FMA, NR
//! rows x NT tokens per tile. No activation rounding: only the summation order differs from the
//! reference `weight::dot`.

// Tiles index several arrays by row and token; index loops read clearest here.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::dot_x86::hsum256;
use super::matmul::FTile;
use hf2q_tensor::GgmlType;

const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

macro_rules! by_type {
    ($f:ident, $nr:expr, $nt:expr, $p:expr, $rs:tt, $ts:tt) => {
        match $p.ty {
            GgmlType::F32 => by_type!(@rows $f, F32, $nr, $nt, $p, $rs, $ts),
            GgmlType::F16 => by_type!(@rows $f, F16, $nr, $nt, $p, $rs, $ts),
            _ => by_type!(@rows $f, BF16, $nr, $nt, $p, $rs, $ts),
        }
    };
    (@rows $f:ident, $ty:ident, $nr:expr, $nt:expr, $p:expr, [$($r:literal),*], $ts:tt) => {
        match $nr {
            $($r => by_type!(@toks $f, $ty, $r, $nt, $p, $ts),)*
            _ => unreachable!("tile rows beyond the engine's maximum"),
        }
    };
    (@toks $f:ident, $ty:ident, $r:literal, $nt:expr, $p:expr, [$($t:literal),*]) => {
        match $nt {
            $($t => $f::<$ty, $r, $t>($p),)*
            _ => unreachable!("tile tokens beyond the engine's maximum"),
        }
    };
}

// ------------------------------------------------------------------------------------------
// AVX-512
// ------------------------------------------------------------------------------------------

/// # Safety
/// The CPU must have AVX-512 F/BW/VL; the tile's pointers must cover its rows and tokens.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn ftile_avx512(nr: usize, nt: usize, p: &FTile) {
    by_type!(ftile512, nr, nt, p, [1, 2, 3, 4], [1, 2, 3, 4])
}

/// 16 weights from element `i` of `row` (the first `popcount(m)` of them; the rest zero).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn load16<const TY: u8>(row: *const u8, i: usize, m: __mmask16) -> __m512 {
    match TY {
        F32 => _mm512_maskz_loadu_ps(m, row.add(4 * i) as *const f32),
        F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, row.add(2 * i) as *const i16)),
        _ => {
            let h = _mm256_maskz_loadu_epi16(m, row.add(2 * i) as *const i16);
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn fstep512<const TY: u8, const NR: usize, const NT: usize>(
    p: &FTile,
    i: usize,
    m: __mmask16,
    acc: &mut [[__m512; NT]; NR],
) {
    let mut w = [_mm512_setzero_ps(); NR];
    for r in 0..NR {
        w[r] = load16::<TY>(p.w.add(r * p.row_bytes), i, m);
    }
    for t in 0..NT {
        let x = _mm512_maskz_loadu_ps(m, p.x.add(t * p.k + i));
        for r in 0..NR {
            acc[r][t] = _mm512_fmadd_ps(w[r], x, acc[r][t]);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn ftile512<const TY: u8, const NR: usize, const NT: usize>(p: &FTile) {
    let k = p.k;
    let mut acc = [[_mm512_setzero_ps(); NT]; NR];
    let mut i = 0;
    while i + 16 <= k {
        fstep512::<TY, NR, NT>(p, i, 0xffff, &mut acc);
        i += 16;
    }
    if i < k {
        fstep512::<TY, NR, NT>(p, i, ((1u32 << (k - i)) - 1) as __mmask16, &mut acc);
    }
    for r in 0..NR {
        for t in 0..NT {
            *p.out.add(t * p.ldo + r) = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
}

// ------------------------------------------------------------------------------------------
// AVX2
// ------------------------------------------------------------------------------------------

/// # Safety
/// The CPU must have AVX2/FMA/F16C; the tile's pointers must cover its rows and tokens.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn ftile_avx2(nr: usize, nt: usize, p: &FTile) {
    by_type!(ftile256, nr, nt, p, [1, 2], [1, 2, 3])
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load8<const TY: u8>(row: *const u8, i: usize) -> __m256 {
    match TY {
        F32 => _mm256_loadu_ps(row.add(4 * i) as *const f32),
        F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * i) as *const __m128i)),
        _ => {
            let h = _mm_loadu_si128(row.add(2 * i) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }
}

/// One weight as f32 (the scalar tail).
#[inline(always)]
unsafe fn load1<const TY: u8>(row: *const u8, i: usize) -> f32 {
    match TY {
        F32 => (row.add(4 * i) as *const f32).read_unaligned(),
        F16 => hf2q_tensor::quant::float::f16_bits_to_f32(
            (row.add(2 * i) as *const u16).read_unaligned(),
        ),
        _ => f32::from_bits(((row.add(2 * i) as *const u16).read_unaligned() as u32) << 16),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ftile256<const TY: u8, const NR: usize, const NT: usize>(p: &FTile) {
    let k = p.k;
    let mut acc = [[_mm256_setzero_ps(); NT]; NR];
    let mut i = 0;
    while i + 8 <= k {
        let mut w = [_mm256_setzero_ps(); NR];
        for r in 0..NR {
            w[r] = load8::<TY>(p.w.add(r * p.row_bytes), i);
        }
        for t in 0..NT {
            let x = _mm256_loadu_ps(p.x.add(t * k + i));
            for r in 0..NR {
                acc[r][t] = _mm256_fmadd_ps(w[r], x, acc[r][t]);
            }
        }
        i += 8;
    }
    for r in 0..NR {
        let row = p.w.add(r * p.row_bytes);
        for t in 0..NT {
            let mut s = hsum256(acc[r][t]);
            for j in i..k {
                s += load1::<TY>(row, j) * *p.x.add(t * k + j);
            }
            *p.out.add(t * p.ldo + r) = s;
        }
    }
}
