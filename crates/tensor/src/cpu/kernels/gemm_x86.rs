//! AVX-512 VNNI prefill GEMM (T >= 16): 16 weight rows side by side in the 16 lanes of a
//! 512-bit vector, so one `vpdpbusd` multiplies 4 codes of each of 16 rows by the same 4
//! activation bytes (broadcast), and the per-row scales are a vector load, not a permute.
//!
//! A 16-row panel is decoded row-major (`unpack.rs`), then rearranged: codes as
//! `[C/4][16 rows][4 bytes]`, scales and offsets as `[C/16][16 rows]` (rows past R are zero).
//! Per 32 elements (formats whose scales change every 32) and token: 8 `vpdpbusd`, then
//! `acc += f32(i) * (a * dx) + c * sx32`: 3 float ops for 512 multiply-adds (the 4x4 row tiles
//! of `dot_x86.rs` spend 4 per 64). Formats with 16-element scales (Q2_K, Q3_K, Q6_K) take the
//! same path per 16. Each token tile of 8 keeps its 8 accumulators over all of C and stores
//! 16 contiguous outputs per token.

// Tiles index several arrays by row and token; index loops read clearest here.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::matmul::{PanelArgs, Scratch};
use super::unpack::{unpack_rows, WView};
use crate::GgmlType;

/// Rows per panel (lanes of a 512-bit f32 vector).
pub(crate) const ROWS: usize = 16;
/// Tokens per tile (accumulators kept in registers).
const NT: usize = 8;

/// Whether the weight's scales and offsets are constant over each 32 elements.
fn per32(w: &WView<'_>) -> bool {
    !matches!(
        w,
        WView::Ggml {
            ty: GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q6_K,
            ..
        }
    )
}

/// # Safety
/// The CPU must have AVX-512 F/BW/VL/VNNI; `p.n <= 16`; `p.out` must cover the (T, R) output.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gemm_panel_avx512(p: &PanelArgs<'_>, s: &mut Scratch) {
    let (k, n, t) = (p.act.k, p.n, p.act.t);
    let g = k / 16;
    unpack_rows(p.w, p.r0, n, k, &mut s.codes, &mut s.a, &mut s.c);
    if s.icodes.len() < ROWS * k / 4 {
        s.icodes.resize(ROWS * k / 4, 0);
    }
    if s.ia.len() < ROWS * g {
        s.ia.resize(ROWS * g, 0.0);
        s.ic.resize(ROWS * g, 0.0);
    }
    // Rearrange (scalar: a few cycles per 4 codes, against 16 * T/8 vector ops that use them).
    for row in 0..ROWS {
        for q in 0..k / 4 {
            s.icodes[q * ROWS + row] = if row < n {
                u32::from_le_bytes(
                    s.codes[row * k + 4 * q..row * k + 4 * q + 4]
                        .try_into()
                        .expect("4 bytes"),
                )
            } else {
                0
            };
        }
        for j in 0..g {
            let (a, c) = if row < n {
                (s.a[row * g + j], s.c[row * g + j])
            } else {
                (0.0, 0.0)
            };
            s.ia[j * ROWS + row] = a;
            s.ic[j * ROWS + row] = c;
        }
    }
    let mask: __mmask16 = if n >= ROWS {
        !0
    } else {
        ((1u32 << n) - 1) as __mmask16
    };
    let g32 = per32(p.w);
    let mut t0 = 0;
    while t0 < t {
        let mt = NT.min(t - t0);
        let args = Gemm {
            k,
            w: s.icodes.as_ptr() as *const i32,
            a: s.ia.as_ptr(),
            c: s.ic.as_ptr(),
            qx: p.act.qx.as_ptr().add(t0 * k),
            dx: p.act.dx.as_ptr().add(t0 * g),
            sx: p.act.sx.as_ptr().add(t0 * g),
            sx32: p.act.sx32.as_ptr().add(t0 * (k / 32)),
            out: p.out.add(t0 * p.ldo + p.r0),
            ldo: p.ldo,
            mask,
        };
        match (g32, mt) {
            (true, 8) => tile::<8, true>(&args),
            (true, 7) => tile::<7, true>(&args),
            (true, 6) => tile::<6, true>(&args),
            (true, 5) => tile::<5, true>(&args),
            (true, 4) => tile::<4, true>(&args),
            (true, 3) => tile::<3, true>(&args),
            (true, 2) => tile::<2, true>(&args),
            (true, _) => tile::<1, true>(&args),
            (false, 8) => tile::<8, false>(&args),
            (false, 7) => tile::<7, false>(&args),
            (false, 6) => tile::<6, false>(&args),
            (false, 5) => tile::<5, false>(&args),
            (false, 4) => tile::<4, false>(&args),
            (false, 3) => tile::<3, false>(&args),
            (false, 2) => tile::<2, false>(&args),
            (false, _) => tile::<1, false>(&args),
        }
        t0 += mt;
    }
}

struct Gemm {
    k: usize,
    /// `[C/4][16]` packed 4-code groups.
    w: *const i32,
    /// `[C/16][16]` scales and offsets.
    a: *const f32,
    c: *const f32,
    /// Token-major activations from the tile's first token: (NT, C), (NT, C/16), (NT, C/32).
    qx: *const i8,
    dx: *const f32,
    sx: *const f32,
    sx32: *const f32,
    out: *mut f32,
    ldo: usize,
    mask: __mmask16,
}

/// The 4 activation bytes at `p` broadcast to every lane.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast4(p: *const i8) -> __m512i {
    _mm512_set1_epi32((p as *const i32).read_unaligned())
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const N: usize, const G32: bool>(p: &Gemm) {
    let (k, g) = (p.k, p.k / 16);
    let mut acc = [_mm512_setzero_ps(); N];
    // Elements per float step: 32 (8 dot steps of 4) or 16 (4 of 4).
    let step = if G32 { 32 } else { 16 };
    let mut e = 0;
    while e < k {
        let j = e / 16;
        let mut w = [_mm512_setzero_si512(); 8];
        for (q, wq) in w.iter_mut().enumerate().take(step / 4) {
            *wq = _mm512_loadu_si512(p.w.add((e / 4 + q) * ROWS) as *const __m512i);
        }
        let a = _mm512_loadu_ps(p.a.add(j * ROWS));
        let c = _mm512_loadu_ps(p.c.add(j * ROWS));
        for t in 0..N {
            let xb = p.qx.add(t * k + e);
            let mut i = _mm512_setzero_si512();
            for (q, wq) in w.iter().enumerate().take(step / 4) {
                i = _mm512_dpbusd_epi32(i, *wq, bcast4(xb.add(4 * q)));
            }
            let d = _mm512_set1_ps(*p.dx.add(t * g + j));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(a, d), acc[t]);
            let sx = if G32 {
                *p.sx32.add(t * (k / 32) + e / 32)
            } else {
                *p.sx.add(t * g + j)
            };
            acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(sx), acc[t]);
        }
        e += step;
    }
    for (t, v) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(p.out.add(t * p.ldo), p.mask, *v);
    }
}
