//! AVX-512 VNNI GEMM (T >= 2): 16 weight rows side by side in the 16 lanes of a 512-bit vector,
//! so one `vpdpbusd` multiplies 4 codes of each of 16 rows by the same 4 activation bytes
//! (broadcast), and the per-row scales are a vector load, not a permute.
//!
//! A 16-row panel is laid out row-interleaved: codes as `[C/4][16 rows][4 bytes]`, scales and
//! offsets as `[C/16][16 rows]` (lanes past R repeat the last row and are never stored). The
//! 32-element ggml blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4) of whole panels are decoded straight
//! from the mapped bytes into that layout: per block, the 16 rows' packed quants are loaded four
//! rows to a 512-bit vector and transposed at 4-byte granularity (8 unpacks), so a nibble mask
//! and shift give the 8 interleaved code vectors (MXFP4's then go through its code table, one
//! byte shuffle each); the block headers (f16 scales, Q5's high bits, MXFP4's E8M0 byte) come
//! in the same way (a 16-lane gather costs more on Zen 4), and the next panel's
//! bytes are prefetched as the blocks go. Other formats (and a partial last panel) are decoded
//! row-major (`unpack.rs`) and transposed the same way. At small T the panel layout was the
//! larger part of the work (a scalar move per 4 codes); now it is a few vector operations per
//! 64 codes, about a fifth of a T = 16 matmul.
//!
//! Per 32 elements (formats whose scales change every 32) and token: 8 `vpdpbusd`, then
//! `acc += f32(i) * (a * dx) + c * sx32`: 3 float ops for 512 multiply-adds. Formats with
//! 16-element scales (Q2_K, Q3_K, Q6_K) take the same path per 16. With two-part activations
//! (`ActBits::Split16`) the two parts of a token are dotted with the same weight vectors into
//! one integer sum, `256 * hi + lo` (at most 32 * 255 * 127 * 257 < 2^31 per lane), scaled
//! once by `a * dx / 256`: the float work per token stays that of one part, and the output is
//! written once, with no second pass adding the halves. Each token tile of 8 keeps its 8
//! accumulators over all of C and stores 16 contiguous outputs per token.

// Tiles index several arrays by row and token; index loops read clearest here.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::matmul::{PanelArgs, Scratch};
use super::unpack::{unpack_rows, WView};
use hf2q_tensor::GgmlType;

/// Rows per panel (lanes of a 512-bit f32 vector).
pub(crate) const ROWS: usize = 16;
/// Tokens per tile (accumulators kept in registers).
const NT: usize = 8;

use super::legacy::{block_bytes, qs_at, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::mxfp4;

/// Whether the weight's scales and offsets are constant over each 32 elements.
fn per32(w: &WView<'_>) -> bool {
    !matches!(
        w,
        WView::Ggml {
            ty: GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q6_K,
            ..
        } | WView::Packed {
            fmt: super::packed::Q6_K,
            ..
        }
    )
}

/// # Safety
/// The CPU must have AVX-512 F/BW/VL/VNNI; `p.n <= 16`; `p.out` must cover the (T, R) output
/// (T = `p.act.t`, or half of it with `p.split`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gemm_panel_avx512(p: &PanelArgs<'_>, s: &mut Scratch) {
    let (k, n) = (p.act.k, p.n);
    let g = k / 16;
    debug_assert!((1..=ROWS).contains(&n));
    if s.icodes.len() < ROWS * k / 4 {
        s.icodes.resize(ROWS * k / 4, 0);
    }
    if s.ia.len() < ROWS * g {
        s.ia.resize(ROWS * g, 0.0);
        s.ic.resize(ROWS * g, 0.0);
    }
    let direct = match *p.w {
        // Whole panels only (a partial one, at the end of R, takes the generic layout).
        WView::Ggml {
            ty,
            data,
            row_bytes,
        } if n == ROWS => {
            let base = data.as_ptr().add(p.r0 * row_bytes);
            match ty {
                GgmlType::Q4_0 => layout_direct::<Q4_0>(base, row_bytes, k, s),
                GgmlType::Q4_1 => layout_direct::<Q4_1>(base, row_bytes, k, s),
                GgmlType::Q5_0 => layout_direct::<Q5_0>(base, row_bytes, k, s),
                GgmlType::Q5_1 => layout_direct::<Q5_1>(base, row_bytes, k, s),
                GgmlType::Q8_0 => layout_direct::<Q8_0>(base, row_bytes, k, s),
                GgmlType::MXFP4 => layout_direct::<MXFP4>(base, row_bytes, k, s),
                _ => false,
            }
        }
        // Any panel, the last one too (the layout's padding rows are zeros).
        WView::Packed { data, nb, fmt } => {
            debug_assert!(p.r0.is_multiple_of(ROWS));
            let g = data
                .as_ptr()
                .add(p.r0 / ROWS * super::packed::group_bytes(nb, fmt));
            super::packed::x86::panel(
                g,
                nb,
                fmt,
                s.icodes.as_mut_ptr() as *mut __m512i,
                s.ia.as_mut_ptr(),
                s.ic.as_mut_ptr(),
            );
            true
        }
        _ => false,
    };
    if !direct {
        layout_generic(p, s);
        prefetch_next_panel(p);
    }
    let mask: __mmask16 = if n >= ROWS {
        !0
    } else {
        ((1u32 << n) - 1) as __mmask16
    };
    let g32 = per32(p.w);
    // Tokens: with split activations, pairs (row t of `act` and its remainder, row T + t).
    let t = if p.split { p.act.t / 2 } else { p.act.t };
    let lo = if p.split { t } else { 0 };
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
            ql: p.act.qx.as_ptr().add((lo + t0) * k),
            dl: p.act.dx.as_ptr().add((lo + t0) * g),
            sp: p.act.sxp.as_ptr().add(t0 * g),
            sp32: p.act.sxp32.as_ptr().add(t0 * (k / 32)),
            out: p.out.add(t0 * p.ldo + p.r0),
            ldo: p.ldo,
            mask,
        };
        macro_rules! go {
            ($g:literal, $s:literal) => {
                match mt {
                    8 => tile::<8, $g, $s>(&args),
                    7 => tile::<7, $g, $s>(&args),
                    6 => tile::<6, $g, $s>(&args),
                    5 => tile::<5, $g, $s>(&args),
                    4 => tile::<4, $g, $s>(&args),
                    3 => tile::<3, $g, $s>(&args),
                    2 => tile::<2, $g, $s>(&args),
                    _ => tile::<1, $g, $s>(&args),
                }
            };
        }
        match (g32, p.split) {
            (true, true) => go!(true, true),
            (true, false) => go!(true, false),
            (false, true) => go!(false, true),
            (false, false) => go!(false, false),
        }
        t0 += mt;
    }
}

/// Asks for the next panel's weight bytes (rows `r0 + 16..r0 + 32`) in L2 while this panel's
/// tiles run (for the generic layout; the direct one spreads its prefetches over its blocks).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn prefetch_next_panel(p: &PanelArgs<'_>) {
    let (r1, r2) = ((p.r0 + ROWS).min(p.ldo), (p.r0 + 2 * ROWS).min(p.ldo));
    let pf = |data: &[u8], row_bytes: usize| {
        let (a, b) = (r1 * row_bytes, r2 * row_bytes);
        let base = data.as_ptr();
        let mut i = a;
        while i < b {
            _mm_prefetch::<_MM_HINT_T1>(base.add(i) as *const i8);
            i += 64;
        }
    };
    match *p.w {
        WView::Ggml {
            data, row_bytes, ..
        } => pf(data, row_bytes),
        WView::Affine {
            packed, row_bytes, ..
        } => pf(packed, row_bytes),
        WView::Packed { .. } => {}
    }
}

/// Four rows of each of four groups: row `4L + i` at `p[L] + so[i]` (a whole 16-row panel,
/// `stride` apart; seven registers instead of sixteen offsets).
#[derive(Clone, Copy)]
struct Rows16 {
    p: [*const u8; 4],
    so: [usize; 4],
}

impl Rows16 {
    fn new(base: *const u8, stride: usize) -> Rows16 {
        Rows16 {
            // Wrapping: the prefetches of the next panel may point past the weight's end.
            p: std::array::from_fn(|l| base.wrapping_add(4 * l * stride)),
            so: [0, stride, 2 * stride, 3 * stride],
        }
    }
    #[inline(always)]
    fn at(&self, row: usize, at: usize) -> *const u8 {
        self.p[row / 4].wrapping_add(self.so[row % 4] + at)
    }
}

/// One vector of four 128-bit loads: rows i, i + 4, i + 8, i + 12 of the panel (`$ld(row)`).
macro_rules! rows4 {
    ($ld:expr, $i:expr) => {
        _mm512_inserti32x4::<3>(
            _mm512_inserti32x4::<2>(
                _mm512_inserti32x4::<1>(_mm512_castsi128_si512($ld($i)), $ld($i + 4)),
                $ld($i + 8),
            ),
            $ld($i + 12),
        )
    };
}

/// [`transpose16x4`] for a whole panel: the 16 bytes at `at` of each row.
///
/// # Safety
/// Inlined into AVX-512 F/BW/VL functions only; the 16 bytes at `at` of every row readable.
#[inline(always)]
unsafe fn transpose16x4_rows(r: &Rows16, at: usize) -> [__m512i; 4] {
    let ld = |i: usize| _mm_loadu_si128(r.at(i, at) as *const __m128i);
    transpose_lanes([rows4!(ld, 0), rows4!(ld, 1), rows4!(ld, 2), rows4!(ld, 3)])
}

/// [`transpose16x4_rows`]'s first two vectors: the 8 bytes at `at` of each row.
///
/// # Safety
/// As [`transpose16x4_rows`], for 8 bytes.
#[inline(always)]
unsafe fn transpose16x2_rows(r: &Rows16, at: usize) -> [__m512i; 2] {
    let ld = |i: usize| _mm_loadl_epi64(r.at(i, at) as *const __m128i);
    let v = [rows4!(ld, 0), rows4!(ld, 1), rows4!(ld, 2), rows4!(ld, 3)];
    let t0 = _mm512_unpacklo_epi32(v[0], v[1]);
    let t2 = _mm512_unpacklo_epi32(v[2], v[3]);
    [_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2)]
}

/// `v[i]` holds rows i, i + 4, i + 8, i + 12 (4 dwords each) in its four 128-bit lanes; a 4x4
/// dword transpose inside every lane gives lane L of vector q = dword q of rows 4L..4L+4, i.e.
/// vector q is dword q of rows 0..16 in order.
///
/// # Safety
/// Inlined into AVX-512 F functions only.
#[inline(always)]
unsafe fn transpose_lanes(v: [__m512i; 4]) -> [__m512i; 4] {
    let t0 = _mm512_unpacklo_epi32(v[0], v[1]);
    let t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    let t2 = _mm512_unpacklo_epi32(v[2], v[3]);
    let t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

/// Byte offsets of the panel's 16 rows, `stride` apart; lanes past `n` repeat the last row.
#[inline(always)]
fn row_offsets(n: usize, stride: usize) -> [usize; ROWS] {
    std::array::from_fn(|i| i.min(n - 1) * stride)
}

/// The 16 bytes at `p + off[i]` for the 16 rows i, transposed at 4-byte granularity: vector q
/// holds bytes 4q..4q+4 of every row, row i in lane i.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn transpose16x4(p: *const u8, off: &[usize; ROWS]) -> [__m512i; 4] {
    let ld = |i: usize| _mm_loadu_si128(p.add(off[i]) as *const __m128i);
    transpose_lanes([rows4!(ld, 0), rows4!(ld, 1), rows4!(ld, 2), rows4!(ld, 3)])
}

/// Decodes the 32-element blocks of the 16 rows `base`, `base + row_bytes`, ... into the
/// interleaved panel. Always true (the caller matched the format).
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL; `base` must start 16 whole rows of `row_bytes` bytes,
/// each `k / 32` blocks of format `F`; `s` must hold a 16-row panel of `k` columns.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn layout_direct<const F: u8>(
    base: *const u8,
    row_bytes: usize,
    k: usize,
    s: &mut Scratch,
) -> bool {
    let bs = block_bytes(F);
    let rows = Rows16::new(base, row_bytes);
    let w = s.icodes.as_mut_ptr() as *mut __m512i;
    let (ia, ic) = (s.ia.as_mut_ptr(), s.ic.as_mut_ptr());
    let lo4 = _mm512_set1_epi8(0x0f);
    let (lut, kmin) = if F == MXFP4 {
        (mxfp4::x86::lut(), mxfp4::tables().kmin)
    } else {
        (_mm512_setzero_si512(), 0.0)
    };
    for b in 0..k / 32 {
        let at = b * bs;
        // The next panel's bytes of this block, in L2 by the time its layout runs (the 16-row
        // pattern is one the hardware prefetchers follow poorly). Past the weight's end this
        // asks for nothing useful, harmlessly: prefetches do not fault.
        let next = ROWS * row_bytes;
        for i in 0..ROWS {
            _mm_prefetch::<_MM_HINT_T1>(rows.at(i, at + next) as *const i8);
        }
        // The first 8 bytes of each row's block: d (and m for Q4_1 / Q5_1) as f16, then qh;
        // MXFP4's E8M0 byte. (A gather of 16 dwords costs more than these 16 loads.)
        let [h0, h1] = transpose16x2_rows(&rows, at);
        let d = if F == MXFP4 {
            mxfp4::x86::half_scales(_mm512_and_si512(h0, _mm512_set1_epi32(0xff)))
        } else {
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h0))
        };
        let c = match F {
            MXFP4 => _mm512_mul_ps(d, _mm512_set1_ps(kmin)),
            Q4_0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
            Q5_0 => _mm512_mul_ps(d, _mm512_set1_ps(-16.0)),
            Q8_0 => _mm512_mul_ps(d, _mm512_set1_ps(-128.0)),
            _ => _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(h0))),
        };
        _mm512_storeu_ps(ia.add(2 * b * ROWS), d);
        _mm512_storeu_ps(ic.add(2 * b * ROWS), c);
        let wb = w.add(8 * b);
        if F == Q8_0 {
            let flip = _mm512_set1_epi8(-128);
            for h in 0..2 {
                let v = transpose16x4_rows(&rows, at + 2 + 16 * h);
                for q in 0..4 {
                    // i8 q -> q + 128.
                    _mm512_storeu_si512(wb.add(4 * h + q), _mm512_xor_si512(v[q], flip));
                }
            }
            continue;
        }
        let v = transpose16x4_rows(&rows, at + qs_at(F));
        let mut u = [_mm512_setzero_si512(); 8];
        for q in 0..4 {
            // Byte j holds elements j (low nibble) and j + 16 (high nibble).
            u[q] = _mm512_and_si512(v[q], lo4);
            u[q + 4] = _mm512_and_si512(_mm512_srli_epi32::<4>(v[q]), lo4);
        }
        if F == Q5_0 || F == Q5_1 {
            // Each row's 32 fifth bits (bit e: element e) in its lane.
            let qh = if F == Q5_0 {
                // Bytes 2..6.
                _mm512_or_si512(_mm512_srli_epi32::<16>(h0), _mm512_slli_epi32::<16>(h1))
            } else {
                h1
            };
            super::packed::x86::add_fifth_bits(&mut u, qh);
        }
        if F == MXFP4 {
            for v in u.iter_mut() {
                *v = mxfp4::x86::lookup(lut, *v);
            }
        }
        for q in 0..8 {
            _mm512_storeu_si512(wb.add(q), u[q]);
        }
    }
    true
}

/// Any other format: decode the rows row-major, then transpose codes and scales.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL; `s` must hold a 16-row panel of `p.act.k` columns.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn layout_generic(p: &PanelArgs<'_>, s: &mut Scratch) {
    let (k, n) = (p.act.k, p.n);
    let g = k / 16;
    unpack_rows(p.w, p.r0, n, k, &mut s.codes, &mut s.a, &mut s.c);
    let off = row_offsets(n, k);
    let w = s.icodes.as_mut_ptr() as *mut __m512i;
    for m in 0..k / 16 {
        let v = transpose16x4(s.codes.as_ptr().add(16 * m), &off);
        for q in 0..4 {
            _mm512_storeu_si512(w.add(4 * m + q), v[q]);
        }
    }
    let gidx = _mm512_loadu_si512(row_offsets(n, g).map(|o| o as i32).as_ptr() as *const __m512i);
    for j in 0..g {
        let a = _mm512_i32gather_ps::<4>(gidx, s.a.as_ptr().add(j));
        let c = _mm512_i32gather_ps::<4>(gidx, s.c.as_ptr().add(j));
        _mm512_storeu_ps(s.ia.as_mut_ptr().add(j * ROWS), a);
        _mm512_storeu_ps(s.ic.as_mut_ptr().add(j * ROWS), c);
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
    /// Split activations only: the second parts' codes and scales, and both parts' sums.
    ql: *const i8,
    dl: *const f32,
    sp: *const f32,
    sp32: *const f32,
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

/// Runs `$body` with `$t` = 0, 1, ... `$n - 1` (`$n` <= 8 a constant), written out so that the
/// accumulators indexed by `$t` stay in registers (a loop this long is not unrolled).
macro_rules! each_token {
    ($n:expr, |$t:ident| $body:block) => {
        each_token!(@at $n, $t, $body, 0, 1, 2, 3, 4, 5, 6, 7)
    };
    (@at $n:expr, $t:ident, $body:block, $($i:literal),*) => {
        $(
            if $i < $n {
                let $t = $i;
                $body
            }
        )*
    };
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const N: usize, const G32: bool, const SPLIT: bool>(p: &Gemm) {
    const { assert!(N <= NT) };
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
        each_token!(N, |t| {
            let xb = p.qx.add(t * k + e);
            let mut i = _mm512_setzero_si512();
            for (q, wq) in w.iter().enumerate().take(step / 4) {
                i = _mm512_dpbusd_epi32(i, *wq, bcast4(xb.add(4 * q)));
            }
            let (d, sx) = if SPLIT {
                // 256 * hi + lo, scaled by the second part's dx / 256.
                i = _mm512_slli_epi32::<8>(i);
                let xl = p.ql.add(t * k + e);
                for (q, wq) in w.iter().enumerate().take(step / 4) {
                    i = _mm512_dpbusd_epi32(i, *wq, bcast4(xl.add(4 * q)));
                }
                let sx = if G32 {
                    *p.sp32.add(t * (k / 32) + e / 32)
                } else {
                    *p.sp.add(t * g + j)
                };
                (*p.dl.add(t * g + j), sx)
            } else {
                let sx = if G32 {
                    *p.sx32.add(t * (k / 32) + e / 32)
                } else {
                    *p.sx.add(t * g + j)
                };
                (*p.dx.add(t * g + j), sx)
            };
            acc[t] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(i),
                _mm512_mul_ps(a, _mm512_set1_ps(d)),
                acc[t],
            );
            acc[t] = _mm512_fmadd_ps(c, _mm512_set1_ps(sx), acc[t]);
        });
        e += step;
    }
    for (t, v) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(p.out.add(t * p.ldo), p.mask, *v);
    }
}
