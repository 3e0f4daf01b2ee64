//! Products through a frozen weight with a low-rank term appended along their depth
//! ([`TrainBackend::linear_low_rank`](hf2q_tensor::train_op::TrainBackend::linear_low_rank) and its
//! input gradient): one cuBLAS product instead of a product and a pass over its output.
//!
//! - Forward, f16 operands (activations are within f16's range; three more bits than bf16):
//!   `[x | s·u] (N, K) · [W | B]ᵀ (R, K)`, K = C + r rounded up with zero columns to a
//!   multiple of `LOW_RANK_ALIGN`.
//! - Input gradient, bf16 operands (gradients need f32's exponent range):
//!   `[dy | s·du] (N, K) · [W ; A] (K, C)`, K = R + r rounded up likewise with zero rows.
//!
//! The weight is dequantized whole per call into scratch (2 bytes a value), its low-rank factor
//! written beside it; a matrix of more than `WEIGHT_CHUNK_VALUES` values, widths that are not a
//! multiple of 8, and a device without cuBLAS answer `None` (the caller composes the two ops).

use super::{ptr, WEIGHT_CHUNK_VALUES};
use crate::backend::CudaBackend;
use crate::train::Gemm;
use hf2q_tensor::{Error, QTensor, Result, Tensor};

/// `x · Wᵀ (+ bias) + scale · u · Bᵀ`, or `None` where this path does not apply.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    be: &CudaBackend,
    x: &Tensor,
    w: &QTensor,
    bias: Option<&[f32]>,
    u: &Tensor,
    b: &Tensor,
    scale: f32,
) -> Result<Option<Tensor>> {
    let (n, c) = x.dims2();
    let (rows, r) = (w.rows, u.dims2().1);
    if c != w.cols
        || u.dims2().0 != n
        || b.dims2() != (rows, r)
        || bias.is_some_and(|b| b.len() != rows)
    {
        return Err(Error::Shape(format!(
            "linear_low_rank '{}' ({rows}x{}): x {:?}, u {:?}, B {:?}, bias {:?}",
            w.name,
            w.cols,
            x.shape(),
            u.shape(),
            b.shape(),
            bias.map(<[f32]>::len)
        )));
    }
    let dev = be.dev();
    let kp = (c + r).next_multiple_of(be.low_rank_align.load(std::sync::atomic::Ordering::Relaxed));
    if n == 0
        || r == 0
        || !c.is_multiple_of(8)
        || rows * kp > WEIGHT_CHUNK_VALUES
        || dev.train_blas()?.is_none()
    {
        return Ok(None);
    }
    let dw = be.weight(w)?;
    let pad = kp - c - r;
    let xb = dev.scratch::<u16>(n * kp)?;
    let xp = dev.addr(&xb);
    dev.pack_cols(
        (ptr(x, "linear_low_rank")?, xp),
        (n, c, kp),
        0,
        0,
        1.0,
        false,
    )?;
    dev.pack_cols(
        (ptr(u, "linear_low_rank")?, xp),
        (n, r, kp),
        c,
        pad,
        scale,
        false,
    )?;
    let wb = dev.scratch::<u16>(rows * kp)?;
    let wp = dev.addr(&wb);
    dev.dequantize_rows_f16(&dw, wp, kp, (0, rows))?;
    dev.pack_cols(
        (ptr(b, "linear_low_rank")?, wp),
        (rows, r, kp),
        c,
        pad,
        1.0,
        false,
    )?;
    let y = be.out(&[n, rows])?;
    let yp = ptr(&y, "linear_low_rank")?;
    let g = Gemm {
        a: xp,
        b: wp,
        c: yp,
        m: n,
        n: rows,
        k: kp,
        ta: false,
        tb: true,
        lda: kp,
        ldb: kp,
        alpha: 1.0,
        accumulate: false,
    };
    dev.gemm_half(&g, false)?;
    if let Some(bias) = bias {
        let bd = be.vector(bias)?;
        dev.add_bias_rows(yp, dev.addr(&bd), n, rows)?;
    }
    Ok(Some(y))
}

/// `dy · W + scale · du · A`, or `None` where this path does not apply.
pub(crate) fn backward_input(
    be: &CudaBackend,
    dy: &Tensor,
    w: &QTensor,
    du: &Tensor,
    a: &Tensor,
    scale: f32,
) -> Result<Option<Tensor>> {
    let (n, rows) = dy.dims2();
    let (c, r) = (w.cols, du.dims2().1);
    if rows != w.rows || du.dims2().0 != n || a.dims2() != (r, c) {
        return Err(Error::Shape(format!(
            "linear_backward_input_low_rank '{}' ({}x{c}): dy {:?}, du {:?}, A {:?}",
            w.name,
            w.rows,
            dy.shape(),
            du.shape(),
            a.shape()
        )));
    }
    let dev = be.dev();
    let kp =
        (rows + r).next_multiple_of(be.low_rank_align.load(std::sync::atomic::Ordering::Relaxed));
    if n == 0 || r == 0 || kp * c > WEIGHT_CHUNK_VALUES || dev.train_blas()?.is_none() {
        return Ok(None);
    }
    let dw = be.weight(w)?;
    let pad = kp - rows - r;
    let what = "linear_backward_input_low_rank";
    let db = dev.scratch::<u16>(n * kp)?;
    let dp = dev.addr(&db);
    dev.pack_cols((ptr(dy, what)?, dp), (n, rows, kp), 0, 0, 1.0, true)?;
    dev.pack_cols((ptr(du, what)?, dp), (n, r, kp), rows, pad, scale, true)?;
    let wt = dev.scratch::<u16>(kp * c)?;
    let wp = dev.addr(&wt);
    dev.dequantize_rows(&dw, wp, c, (0, rows), false)?;
    let ap = wp + (rows * c * 2) as u64;
    dev.pack_cols((ptr(a, what)?, ap), (r, c, c), 0, 0, 1.0, true)?;
    dev.memset(ap + (r * c * 2) as u64, 0, pad * c * 2)?;
    let dx = be.out(&[n, c])?;
    let g = Gemm {
        a: dp,
        b: wp,
        c: ptr(&dx, what)?,
        m: n,
        n: c,
        k: kp,
        ta: false,
        tb: false,
        lda: kp,
        ldb: c,
        alpha: 1.0,
        accumulate: false,
    };
    dev.gemm_bf16(&g)?;
    Ok(Some(dx))
}
