//! x86-64 integer engines for decoded weights (`unpack.rs`) against 8-bit activations
//! (`q8act.rs`): AVX-512 VNNI (`vpdpbusd`, 64 bytes per instruction) and AVX2 (`vpmaddubsw` +
//! `vpmaddwd`, 32 bytes). Both compute what `scalar::qdot` computes, per tile of NR rows x NT
//! tokens so that each loaded weight vector serves NT tokens and each activation vector NR rows.
//!
//! Per step and (row, token) pair: an integer dot of 4-byte groups into i32 lanes (lane i covers
//! elements 4i..4i+4, so lanes 0-3 are the first 16-element group, 4-7 the second, ...), then
//! `acc += f32(lanes) * (a * dx)` with `a` and `dx` spread from per-16 values to their lanes by
//! a permute. The offsets `Σ c * sx` are one f32 dot of C/16 values per pair at the end.
//!
//! Wide codes (all 8 bits used: Q8_0, Q8_K, MLX 8-bit) overflow `vpmaddubsw`'s i16 pair sums
//! (255 * 127 * 2 > 32767), so AVX2 reads them as signed `w = u - 128` and multiplies
//! `|w| * (x * sign w)` (at most 128 * 127 * 2 = 32512), adding back `128 * Σ a * sx` at the end.
//! `vpdpbusd` sums into i32 without saturation and needs nothing of the sort.

// Tiles index several arrays by row and token; index loops read clearest here.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::float_x86;
use super::matmul::{quant_panel, Kernels, PanelArgs, QTile, Scratch};
use super::q8act;

pub(crate) const AVX512: Kernels = Kernels {
    quantize_row: q8act::x86::quantize_row_avx512,
    quantize_row_split: q8act::x86::quantize_row_split_avx512,
    panel: panel_avx512,
    ftile: float_x86::ftile_avx512,
    matvec: Some(super::fused_x86::matvec_avx512),
    gemm: Some((super::gemm_x86::gemm_panel_avx512, super::gemm_x86::ROWS)),
    nr: 4,
    nt: 4,
};

pub(crate) const AVX2: Kernels = Kernels {
    quantize_row: q8act::x86::quantize_row_avx2,
    quantize_row_split: q8act::x86::quantize_row_split_avx2,
    panel: panel_avx2,
    ftile: float_x86::ftile_avx2,
    matvec: None,
    gemm: None,
    nr: 2,
    nt: 3,
};

/// Calls `$f::<NR, NT>` for the runtime (nr, nt), both at most the table's maximum.
macro_rules! dispatch_tile {
    ($f:ident, $nr:expr, $nt:expr, $p:expr, [$($r:literal),*], [$($t:literal),*]) => {
        dispatch_tile!(@rows $f, $nr, $nt, $p, [$($r),*], [$($t),*])
    };
    (@rows $f:ident, $nr:expr, $nt:expr, $p:expr, [$($r:literal),*], $ts:tt) => {
        match $nr {
            $($r => dispatch_tile!(@toks $f, $r, $nt, $p, $ts),)*
            _ => unreachable!("tile rows beyond the engine's maximum"),
        }
    };
    (@toks $f:ident, $r:literal, $nt:expr, $p:expr, [$($t:literal),*]) => {
        match $nt {
            $($t => $f::<$r, $t>($p),)*
            _ => unreachable!("tile tokens beyond the engine's maximum"),
        }
    };
}

// ------------------------------------------------------------------------------------------
// AVX-512 VNNI
// ------------------------------------------------------------------------------------------

/// # Safety
/// The CPU must have AVX-512 F/BW/VL/VNNI; `p.out` must cover the (T, R) output.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn panel_avx512(p: &PanelArgs<'_>, s: &mut Scratch) {
    quant_panel(p, s, 4, 4, tile_avx512)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_avx512(nr: usize, nt: usize, p: &QTile) {
    dispatch_tile!(qtile512, nr, nt, p, [1, 2, 3, 4], [1, 2, 3, 4])
}

/// Spreads 4 per-16 values (at `v`) over 16 lanes (lane i gets value i / 4); `m` masks the
/// values read (0b1111, or 0b11 for a 32-element tail).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn spread4(v: *const f32, m: __mmask16) -> __m512 {
    let idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(m, v))
}

/// f32 dot of `n` values.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn fdot512(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i)), acc);
        i += 16;
    }
    if i < n {
        let m = ((1u32 << (n - i)) - 1) as __mmask16;
        acc = _mm512_fmadd_ps(
            _mm512_maskz_loadu_ps(m, a.add(i)),
            _mm512_maskz_loadu_ps(m, b.add(i)),
            acc,
        );
    }
    _mm512_reduce_add_ps(acc)
}

/// One step of 64 elements (or 32 with `mb`/`mf` masking the upper half off).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn step512<const NR: usize, const NT: usize>(
    p: &QTile,
    kk: usize,
    mb: __mmask64,
    mf: __mmask16,
    acc: &mut [[__m512; NT]; NR],
) {
    let (k, g, j) = (p.k, p.k / 16, kk / 16);
    let mut w = [_mm512_setzero_si512(); NR];
    let mut s = [_mm512_setzero_ps(); NR];
    for r in 0..NR {
        w[r] = _mm512_maskz_loadu_epi8(mb, p.codes.add(r * k + kk) as *const i8);
        s[r] = spread4(p.a.add(r * g + j), mf);
    }
    for t in 0..NT {
        let x = _mm512_maskz_loadu_epi8(mb, p.qx.add(t * k + kk));
        let d = spread4(p.dx.add(t * g + j), mf);
        for r in 0..NR {
            let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], x);
            acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[r], d), acc[r][t]);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn qtile512<const NR: usize, const NT: usize>(p: &QTile) {
    let (k, g) = (p.k, p.k / 16);
    let mut acc = [[_mm512_setzero_ps(); NT]; NR];
    let mut kk = 0;
    while kk + 64 <= k {
        step512::<NR, NT>(p, kk, !0, 0xf, &mut acc);
        kk += 64;
    }
    if kk < k {
        // C is a multiple of 32: one half step is left.
        step512::<NR, NT>(p, kk, 0xffff_ffff, 0x3, &mut acc);
    }
    for r in 0..NR {
        for t in 0..NT {
            let off = fdot512(p.c.add(r * g), p.sx.add(t * g), g);
            *p.out.add(t * p.ldo + r) = _mm512_reduce_add_ps(acc[r][t]) + off;
        }
    }
}

// ------------------------------------------------------------------------------------------
// AVX2
// ------------------------------------------------------------------------------------------

/// # Safety
/// The CPU must have AVX2/FMA/F16C; `p.out` must cover the (T, R) output.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_avx2(p: &PanelArgs<'_>, s: &mut Scratch) {
    quant_panel(p, s, 2, 3, tile_avx2)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2(nr: usize, nt: usize, p: &QTile) {
    if p.wide {
        dispatch_tile!(qtile256w, nr, nt, p, [1, 2], [1, 2, 3])
    } else {
        dispatch_tile!(qtile256n, nr, nt, p, [1, 2], [1, 2, 3])
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qtile256n<const NR: usize, const NT: usize>(p: &QTile) {
    qtile256::<NR, NT, false>(p)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qtile256w<const NR: usize, const NT: usize>(p: &QTile) {
    qtile256::<NR, NT, true>(p)
}

/// Horizontal sum of 8 f32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// f32 dot of `n` values.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn fdot256(a: *const f32, b: *const f32, n: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc);
        i += 8;
    }
    let mut s = hsum256(acc);
    while i < n {
        s += *a.add(i) * *b.add(i);
        i += 1;
    }
    s
}

/// Spreads 2 per-16 values over 8 lanes (lanes 0-3 the first, 4-7 the second).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn spread2(v: *const f32) -> __m256 {
    let pair = _mm_castpd_ps(_mm_load_sd(v as *const f64));
    _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(pair),
        _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0),
    )
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qtile256<const NR: usize, const NT: usize, const WIDE: bool>(p: &QTile) {
    let (k, g) = (p.k, p.k / 16);
    let ones = _mm256_set1_epi16(1);
    let flip = _mm256_set1_epi8(-128);
    let mut acc = [[_mm256_setzero_ps(); NT]; NR];
    let mut kk = 0;
    while kk < k {
        let j = kk / 16;
        let mut w = [_mm256_setzero_si256(); NR];
        let mut wa = [_mm256_setzero_si256(); NR];
        let mut s = [_mm256_setzero_ps(); NR];
        for r in 0..NR {
            w[r] = _mm256_loadu_si256(p.codes.add(r * k + kk) as *const __m256i);
            if WIDE {
                w[r] = _mm256_xor_si256(w[r], flip); // u - 128 as i8
                wa[r] = _mm256_abs_epi8(w[r]);
            }
            s[r] = spread2(p.a.add(r * g + j));
        }
        for t in 0..NT {
            let x = _mm256_loadu_si256(p.qx.add(t * k + kk) as *const __m256i);
            let d = spread2(p.dx.add(t * g + j));
            for r in 0..NR {
                let prod = if WIDE {
                    _mm256_maddubs_epi16(wa[r], _mm256_sign_epi8(x, w[r]))
                } else {
                    _mm256_maddubs_epi16(w[r], x)
                };
                let dot = _mm256_madd_epi16(prod, ones);
                acc[r][t] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s[r], d), acc[r][t]);
            }
        }
        kk += 32;
    }
    for r in 0..NR {
        for t in 0..NT {
            let mut off = fdot256(p.c.add(r * g), p.sx.add(t * g), g);
            if WIDE {
                off += 128.0 * fdot256(p.a.add(r * g), p.sx.add(t * g), g);
            }
            *p.out.add(t * p.ldo + r) = hsum256(acc[r][t]) + off;
        }
    }
}
