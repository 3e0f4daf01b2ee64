//! One run of a served adapter's low-rank term on its rows, in place and on the calling thread:
//! `y (n, R) += scale · (x (n, C) · Aᵀ) · Bᵀ` for `A (k, C)` and `Bᵀ (k, R)` kept transposed
//! (`RowsTerm::b_t`), so that both products read whole rows: `k · n` dot products of length
//! `C`, then `k · n` row updates of length `R`. A decode step's runs are a few rows against a
//! rank of 8-64, where a general matrix product's set-up (packing, blocking, dispatch) costs
//! more than the arithmetic; here there is none. Longer runs (prefill chunks) go to the general
//! products, whose blocking pays there ([`MAX_ROWS`]).
//!
//! Not here: splitting the batch into runs and over threads (`dense::add_row_terms`), or the
//! general products (`dense::gemm_f32`).

use super::kernels::Isa;

/// `ys (n, R) += scale · (xs (n, C) · Aᵀ) · Bᵀ` with `a (k, C)` and `b_t (k, R)`; `xa` is scratch
/// of at least `n · k` values. The slices hold whole rows (checked by the caller).
pub(crate) fn add_low_rank_rows(
    xs: &[f32],
    ys: &mut [f32],
    a: &[f32],
    b_t: &[f32],
    scale: f32,
    (c, k, r): (usize, usize, usize),
    xa: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx512(
            xs: &[f32],
            ys: &mut [f32],
            a: &[f32],
            b_t: &[f32],
            scale: f32,
            dims: (usize, usize, usize),
            xa: &mut [f32],
        ) {
            body(xs, ys, a, b_t, scale, dims, xa)
        }
        #[target_feature(enable = "avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx2(
            xs: &[f32],
            ys: &mut [f32],
            a: &[f32],
            b_t: &[f32],
            scale: f32,
            dims: (usize, usize, usize),
            xa: &mut [f32],
        ) {
            body(xs, ys, a, b_t, scale, dims, xa)
        }
        match Isa::best() {
            // SAFETY: `Isa::best` names a level this CPU runs.
            Isa::Avx512Vnni => return unsafe { avx512(xs, ys, a, b_t, scale, (c, k, r), xa) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { avx2(xs, ys, a, b_t, scale, (c, k, r), xa) },
            _ => {}
        }
    }
    body(xs, ys, a, b_t, scale, (c, k, r), xa)
}

/// [`add_low_rank_rows`] in plain loops that the vector unit of the enclosing function
/// compiles (lanes kept apart, so no reassociation is needed).
#[inline(always)]
fn body(
    xs: &[f32],
    ys: &mut [f32],
    a: &[f32],
    b_t: &[f32],
    scale: f32,
    (c, k, r): (usize, usize, usize),
    xa: &mut [f32],
) {
    // xa (n, k) = scale · xs · Aᵀ
    for (x, out) in xs.chunks_exact(c).zip(xa.chunks_exact_mut(k)) {
        for (o, arow) in out.iter_mut().zip(a.chunks_exact(c)) {
            *o = scale * dot16(x, arow);
        }
    }
    // ys[i] += Σ_j xa[i, j] · Bᵀ[j], by blocks of COLUMNS outputs: a block of Bᵀ (k rows of
    // COLUMNS) stays in the first-level cache for every row.
    for o in (0..r).step_by(COLUMNS) {
        let w = COLUMNS.min(r - o);
        for (y, s) in ys.chunks_exact_mut(r).zip(xa.chunks_exact(k)) {
            let y = &mut y[o..o + w];
            for (&s, brow) in s.iter().zip(b_t.chunks_exact(r)) {
                for (yv, &bv) in y.iter_mut().zip(&brow[o..o + w]) {
                    *yv += s * bv;
                }
            }
        }
    }
}

/// Outputs per block of the second product: a block of `Bᵀ` is `k · COLUMNS` f32 (16 KiB at
/// rank 16).
const COLUMNS: usize = 256;

/// Runs of at most this many rows take the direct kernel; longer ones (a prompt's prefill
/// chunk) are products large enough for the general kernels' blocking to pay.
pub(crate) const MAX_ROWS: usize = 16;

/// `x · y` over 16 lanes kept apart, then summed by halving.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn dot16(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (xc, yc) = (x.chunks_exact(16), y.chunks_exact(16));
    let tail: f32 = xc
        .remainder()
        .iter()
        .zip(yc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (xv, yv) in xc.zip(yc) {
        for l in 0..16 {
            acc[l] += xv[l] * yv[l];
        }
    }
    super::attention::sum16(&acc) + tail
}
