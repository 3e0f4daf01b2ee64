//! One run of a served adapter's low-rank term on its rows, in place and on the calling thread:
//! `y (n, R) += scale · (x (n, C) · Aᵀ) · Bᵀ` for `A (k, C)` and `Bᵀ (k, R)` kept transposed
//! (`RowsTerm::b_t`), so that both products read whole rows: `k · n` dot products of length
//! `C`, then `k · n` row updates of length `R`, on the attention's f32 kernels. A decode step's runs are a few rows against a
//! rank of 8-64, where a general matrix product's set-up (packing, blocking, dispatch) costs
//! more than the arithmetic; here there is none. Longer runs (prefill chunks) go to the general
//! products, whose blocking pays there ([`MAX_ROWS`]).
//!
//! Not here: splitting the batch into runs and over threads (`dense::add_row_terms`), or the
//! general products (`dense::gemm_f32`).

use super::attention::{KvRead, PORTABLE};
#[cfg(target_arch = "x86_64")]
use super::attention::{AVX2, AVX512};
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
            body::<AVX512>(xs, ys, a, b_t, scale, dims, xa)
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
            body::<AVX2>(xs, ys, a, b_t, scale, dims, xa)
        }
        match Isa::best() {
            // SAFETY: `Isa::best` names a level this CPU runs.
            Isa::Avx512Vnni => return unsafe { avx512(xs, ys, a, b_t, scale, (c, k, r), xa) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { avx2(xs, ys, a, b_t, scale, (c, k, r), xa) },
            _ => {}
        }
    }
    body::<PORTABLE>(xs, ys, a, b_t, scale, (c, k, r), xa)
}

/// [`add_low_rank_rows`] with the f32 cache kernels of the attention (`KvRead for f32` at
/// vector level `L`): each row's `k` dot products against `A`'s rows, then its update along
/// `Bᵀ`'s rows (`acc += Σ_j p_j v_j`, 64 columns kept in registers across the `k` rows).
#[inline(always)]
fn body<const L: u8>(
    xs: &[f32],
    ys: &mut [f32],
    a: &[f32],
    b_t: &[f32],
    scale: f32,
    (c, k, r): (usize, usize, usize),
    xa: &mut [f32],
) {
    for (x, out) in xs.chunks_exact(c).zip(xa.chunks_exact_mut(k)) {
        for (o, arow) in out.iter_mut().zip(a.chunks_exact(c)) {
            *o = scale * <f32 as KvRead>::dot::<L>(x, arow);
        }
    }
    for (y, s) in ys.chunks_exact_mut(r).zip(xa.chunks_exact(k)) {
        <f32 as KvRead>::accumulate::<L>(y, s, b_t);
    }
}

/// Runs of at most this many rows take the direct kernel; longer ones (a prompt's prefill
/// chunk) are products large enough for the general kernels' blocking to pay.
pub(crate) const MAX_ROWS: usize = 16;
