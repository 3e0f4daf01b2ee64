//! Dense f32 products on the CPU over the `gemm` crate (packed micro-kernels for the CPU at
//! hand, rayon-parallel): LoRA's factors (served adapters' terms written onto their rows in
//! place), training's gradient products, and the backward of a product through a frozen
//! weight, whose rows are dequantized in chunks (as the forward's reference path reads them)
//! and multiplied in f32.
//!
//! Not here: the forward `x · Wᵀ` of a stored weight (`CpuBackend::linear`, which keeps its
//! reference and SIMD paths).

use rayon::prelude::*;

use hf2q_tensor::lora_rows::{check_terms, RowsTerm};
use hf2q_tensor::op::MatmulSpec;
use hf2q_tensor::{Error, QTensor, Result, Tensor};

/// Products smaller than this many multiply-adds run on one thread (splitting costs more).
const PARALLEL_MACS: usize = 1 << 18;

/// Weight rows dequantized at a time by [`linear_backward_input`]: at most this many f32 values
/// (16 MiB), so a chunk stays in the last-level cache's neighbourhood however wide the rows.
const DEQUANT_CHUNK_VALUES: usize = 4 << 20;

fn parallelism(m: usize, k: usize, n: usize) -> gemm::Parallelism {
    if m.saturating_mul(k).saturating_mul(n) < PARALLEL_MACS {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    }
}

/// `out (M, N) = beta_out · out + alpha · op(a) · op(b)` over row-major slices; `op(a) (M, K)`
/// with `a` stored `(K, M)` when `ta`, `op(b) (K, N)` with `b` stored `(N, K)` when `tb`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32(
    out: &mut [f32],
    accumulate: bool,
    a: &[f32],
    b: &[f32],
    dims: (usize, usize, usize),
    ta: bool,
    tb: bool,
    alpha: f32,
) -> Result<()> {
    let par = parallelism(dims.0, dims.1, dims.2);
    gemm_f32_on(par, out, accumulate, a, b, dims, ta, tb, alpha)
}

/// [`gemm_f32`] on the calling thread alone (inside work that is already split over threads).
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32_serial(
    out: &mut [f32],
    accumulate: bool,
    a: &[f32],
    b: &[f32],
    dims: (usize, usize, usize),
    ta: bool,
    tb: bool,
    alpha: f32,
) -> Result<()> {
    gemm_f32_on(
        gemm::Parallelism::None,
        out,
        accumulate,
        a,
        b,
        dims,
        ta,
        tb,
        alpha,
    )
}

#[allow(clippy::too_many_arguments)]
fn gemm_f32_on(
    par: gemm::Parallelism,
    out: &mut [f32],
    accumulate: bool,
    a: &[f32],
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    ta: bool,
    tb: bool,
    alpha: f32,
) -> Result<()> {
    if out.len() != m * n || a.len() != m * k || b.len() != k * n {
        return Err(Error::Shape(format!(
            "gemm ({m}, {k}) x ({k}, {n}): operands of {} and {} values, output of {}",
            a.len(),
            b.len(),
            out.len()
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            out.fill(0.0);
        }
        return Ok(());
    }
    // Strides (column, row) of each operand as stored: a row-major (r, c) matrix has cs 1 and
    // rs c; its transpose as an operand swaps them.
    let (a_cs, a_rs) = if ta { (m as isize, 1) } else { (1, k as isize) };
    let (b_cs, b_rs) = if tb { (k as isize, 1) } else { (1, n as isize) };
    // SAFETY: every pointer covers its matrix at the strides given (checked lengths above), the
    // output does not alias the inputs (distinct borrows), and gemm reads `out` only when
    // `read_dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            alpha,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

/// [`hf2q_tensor::op::Backend::matmul`] on host tensors.
pub fn matmul(a: &Tensor, b: &Tensor, spec: MatmulSpec) -> Result<Tensor> {
    let (m, k, n) = spec.dims(a, b)?;
    let mut out = vec![0f32; m * n];
    gemm_f32(
        &mut out,
        false,
        a.data(),
        b.data(),
        (m, k, n),
        spec.ta,
        spec.tb,
        spec.alpha,
    )?;
    Tensor::new(&[m, n], out)
}

/// [`hf2q_tensor::op::Backend::matmul_acc`] on host tensors.
pub fn matmul_acc(out: &mut Tensor, a: &Tensor, b: &Tensor, spec: MatmulSpec) -> Result<()> {
    let (m, k, n) = spec.dims(a, b)?;
    if out.dims2() != (m, n) {
        return Err(Error::Shape(format!(
            "matmul_acc: output is {:?}, the product ({m}, {n})",
            out.shape()
        )));
    }
    gemm_f32(
        out.data_mut(),
        true,
        a.data(),
        b.data(),
        (m, k, n),
        spec.ta,
        spec.tb,
        spec.alpha,
    )
}

/// [`hf2q_tensor::op::Backend::add_row_terms`] on host tensors: each run's rows of `x` and `y`
/// read and written in place (no gather, no scatter), `x[run] · Aᵀ` into a `(n, r)` scratch
/// and `scale · (·) · Bᵀ` accumulated straight into `y[run]`; the runs split over threads.
/// A run of a term that brings `Bᵀ` (`RowsTerm::b_t`) runs on the direct kernel when it is
/// short (`low_rank`: a decode step's few rows per adapter, where a general product's set-up
/// outweighs the work); longer runs and terms without `Bᵀ` on `gemm_f32`.
pub fn add_row_terms(x: &Tensor, y: &mut Tensor, terms: &[RowsTerm<'_>]) -> Result<()> {
    check_terms(x, y, terms)?;
    let (c, r) = (x.dims2().1, y.dims2().1);
    // (first row, rows, term), in row order (runs are disjoint: checked).
    let mut runs: Vec<(usize, usize, &RowsTerm<'_>)> = terms
        .iter()
        .flat_map(|t| t.runs.iter().map(move |&(s, n)| (s, n, t)))
        .filter(|&(_, n, _)| n > 0)
        .collect();
    runs.sort_unstable_by_key(|&(s, _, _)| s);
    // Each run's input rows and its own slice of the output.
    let xd = x.data();
    let mut rest = y.data_mut();
    let mut at = 0;
    let mut jobs = Vec::with_capacity(runs.len());
    for (s, n, term) in runs {
        let tail = std::mem::take(&mut rest).split_at_mut((s - at) * r).1;
        let (mine, tail) = tail.split_at_mut(n * r);
        rest = tail;
        at = s + n;
        jobs.push((&xd[s * c..(s + n) * c], mine, term));
    }
    let run = |(xs, ys, term): (&[f32], &mut [f32], &RowsTerm<'_>)| -> Result<()> {
        let (n, rank) = (xs.len() / c, term.a.dims2().0);
        // (n, r)
        let mut xa = vec![0f32; n * rank];
        if let Some(b_t) = term.b_t.filter(|_| n <= crate::low_rank::MAX_ROWS) {
            let dims = (c, rank, r);
            let (a, b_t) = (term.a.data(), b_t.data());
            crate::low_rank::add_low_rank_rows(xs, ys, a, b_t, term.scale, dims, &mut xa);
            return Ok(());
        }
        gemm_f32(
            &mut xa,
            false,
            xs,
            term.a.data(),
            (n, c, rank),
            false,
            true,
            1.0,
        )?;
        gemm_f32(
            ys,
            true,
            &xa,
            term.b.data(),
            (n, rank, r),
            false,
            true,
            term.scale,
        )
    };
    // Multiply-adds of all the runs: a decode step's few rows per adapter run on this thread
    // (splitting them costs more than they take).
    let macs: usize = jobs
        .iter()
        .map(|(xs, _, t)| xs.len() / c * t.a.dims2().0 * (c + r))
        .sum();
    if jobs.len() > 1 && macs >= PARALLEL_MACS {
        jobs.into_par_iter().try_for_each(run)
    } else {
        jobs.into_iter().try_for_each(run)
    }
}

/// A source of a weight's f32 rows: the weight itself, or the fast path's packed copy (whose
/// original pages were handed back and should not be faulted in again).
pub trait RowSource: Sync {
    fn dequantize_row(&self, r: usize, dst: &mut [f32]) -> Result<()>;
}

impl RowSource for QTensor {
    fn dequantize_row(&self, r: usize, dst: &mut [f32]) -> Result<()> {
        QTensor::dequantize_row(self, r, dst)
    }
}

/// `dy (N, R) · W (R, C) -> (N, C)` with `W`'s rows read from `rows` in chunks.
pub fn linear_backward_input(dy: &Tensor, w: &QTensor, rows: &dyn RowSource) -> Result<Tensor> {
    backward_input_chunked(dy, w, rows, DEQUANT_CHUNK_VALUES)
}

/// [`linear_backward_input`] dequantizing at most `chunk_values` weight values at a time.
fn backward_input_chunked(
    dy: &Tensor,
    w: &QTensor,
    rows: &dyn RowSource,
    chunk_values: usize,
) -> Result<Tensor> {
    let (n, r) = dy.dims2();
    let c = w.cols;
    if r != w.rows {
        return Err(Error::Shape(format!(
            "linear backward '{}': gradient has {r} features, the weight {} rows",
            w.name, w.rows
        )));
    }
    let mut dx = vec![0f32; n * c];
    let chunk = (chunk_values / c.max(1)).clamp(1, r.max(1));
    let mut wbuf = vec![0f32; chunk * c];
    // dy's columns r0..r1 as a contiguous (N, r1 - r0) block.
    let mut dyc = vec![0f32; n * chunk];
    let dyd = dy.data();
    for r0 in (0..r).step_by(chunk) {
        let rc = chunk.min(r - r0);
        let wc = &mut wbuf[..rc * c];
        wc.par_chunks_mut(c)
            .enumerate()
            .try_for_each(|(i, dst)| rows.dequantize_row(r0 + i, dst))?;
        let dc = &mut dyc[..n * rc];
        for (i, row) in dc.chunks_mut(rc).enumerate() {
            row.copy_from_slice(&dyd[i * r + r0..i * r + r0 + rc]);
        }
        gemm_f32(&mut dx, r0 > 0, dc, wc, (n, rc, c), false, false, 1.0)?;
    }
    Tensor::new(&[n, c], dx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(
        a: &[f32],
        b: &[f32],
        (m, k, n): (usize, usize, usize),
        ta: bool,
        tb: bool,
    ) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    let av = if ta { a[p * m + i] } else { a[i * k + p] };
                    let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                    s += av as f64 * bv as f64;
                }
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn every_transpose_matches_naive() {
        let (m, k, n) = (13, 70, 9);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37) % 19) as f32 * 0.1 - 0.9)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 53) % 23) as f32 * 0.07 - 0.8)
            .collect();
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let want = naive(&a, &b, (m, k, n), ta, tb);
            let mut out = vec![1f32; m * n];
            gemm_f32(&mut out, true, &a, &b, (m, k, n), ta, tb, 2.0).unwrap();
            for (o, w) in out.iter().zip(&want) {
                assert!((o - (1.0 + 2.0 * w)).abs() < 1e-4, "{ta} {tb}: {o} vs {w}");
            }
        }
    }

    #[test]
    fn backward_input_through_quantized_rows() {
        let (r, c, n) = (40, 64, 5);
        let w: Vec<f32> = (0..r * c)
            .map(|i| ((i * 7) % 29) as f32 * 0.05 - 0.7)
            .collect();
        let q = QTensor::from_f32("w", r, c, &w).unwrap();
        let dy: Vec<f32> = (0..n * r)
            .map(|i| ((i * 11) % 13) as f32 * 0.1 - 0.6)
            .collect();
        let dyt = Tensor::new(&[n, r], dy.clone()).unwrap();
        let want = naive(&dy, &w, (n, r, c), false, false);
        // One chunk, and chunks of 3 rows (the last one short).
        for chunk_values in [usize::MAX / 2, 3 * c] {
            let got = backward_input_chunked(&dyt, &q, &q, chunk_values).unwrap();
            for (g, w) in got.data().iter().zip(&want) {
                assert!((g - w).abs() < 1e-4);
            }
        }
        let bad = Tensor::new(&[n, r - 1], vec![0.0; n * (r - 1)]).unwrap();
        assert!(linear_backward_input(&bad, &q, &q).is_err());
    }
}
