//! The output layer fused with the log-softmax at each row's target on the GPU
//! ([`TrainBackend::lm_head_logprobs`](hf2q_tensor::train_op::TrainBackend::lm_head_logprobs); the
//! reference is `cpu/train/head.rs`): only rows with a target are computed, in chunks of at most
//! `HEAD_CHUNK_LOGITS` logits, so the (N, V) logits never exist at once.
//!
//! Per chunk of rows: their hidden states gathered as bf16, `z = h · Wᵀ` (cuBLAS GemmEx, bf16
//! operands, f32 logits), one block per row for the log-softmax, the argmax and the gradient
//! `g (onehot − softmax)` (as bf16), then `dh = dz · W` (GemmEx) scattered back to the rows. The
//! weight is dequantized to bf16 once per call (a BF16 weight is used as stored): 2 bytes per
//! weight of scratch (an 8B model's 128256 x 4096 output layer: 1 GiB) for one dequantization
//! instead of one per chunk. Without cuBLAS each chunk goes through `linear` and
//! `linear_backward_input` in f32 instead.

use super::{ptr, HEAD_CHUNK_LOGITS};
use crate::backend::CudaBackend;
use crate::train::Gemm;
use hf2q_tensor::op::Backend;
use hf2q_tensor::train_op::{check_head, HeadOut, TrainBackend};
use hf2q_tensor::{Error, QTensor, Result, Tensor};

pub(crate) fn lm_head_logprobs(
    be: &CudaBackend,
    h: &Tensor,
    w: &QTensor,
    targets: &[i32],
    softcap: Option<f32>,
    grad: Option<&[f32]>,
) -> Result<HeadOut> {
    let (n, d) = h.dims2();
    let vocab = w.rows;
    check_head(n, vocab, targets, grad)?;
    if d != w.cols {
        return Err(Error::Shape(format!(
            "lm head '{}': hidden states of {d} for a weight of {} columns",
            w.name, w.cols
        )));
    }
    if softcap.is_some_and(|c| !(c > 0.0)) {
        return Err(Error::Shape(format!("lm head: soft cap {softcap:?}")));
    }
    let cap = softcap.unwrap_or(0.0);
    let rows: Vec<i32> = (0..n)
        .filter(|&i| targets[i] >= 0)
        .map(|i| i as i32)
        .collect();
    let mut logp = vec![0f32; n];
    let mut hit = vec![false; n];
    let dh = grad.map(|_| be.zeros(&[n, d])).transpose()?;
    if rows.is_empty() {
        return Ok(HeadOut { logp, hit, dh });
    }
    let nt = rows.len();
    let dev = be.dev();
    let tg: Vec<i32> = rows.iter().map(|&r| targets[r as usize]).collect();
    let rows_d = dev.upload(&rows)?;
    let tg_d = dev.upload(&tg)?;
    let g_d = grad
        .map(|g| dev.upload(&rows.iter().map(|&r| g[r as usize]).collect::<Vec<f32>>()))
        .transpose()?;
    let logp_d = dev.scratch::<f32>(nt)?;
    let hit_d = dev.scratch::<i32>(nt)?;
    let (rp, tp, gp) = (
        dev.addr(&rows_d),
        dev.addr(&tg_d),
        g_d.as_ref().map_or(0, |b| dev.addr(b)),
    );
    let (lp, hp) = (dev.addr(&logp_d), dev.addr(&hit_d));
    let hptr = ptr(h, "lm head")?;
    let chunk = (HEAD_CHUNK_LOGITS / vocab.max(1)).clamp(1, nt);
    let at = |p: u64, i: usize| p + (i * 4) as u64;

    if dev.train_blas()?.is_some() {
        let dw = be.weight(w)?;
        let wb = if dw.kind() == "bf16" {
            None
        } else {
            let b = dev.scratch::<u16>(vocab * d)?;
            dev.dequantize_rows(&dw, dev.addr(&b), d, (0, vocab), false)?;
            Some(b)
        };
        let wp = wb.as_ref().map_or(dw.args(dev).data, |b| dev.addr(b));
        let hb = dev.scratch::<u16>(chunk * d)?;
        let hbp = dev.addr(&hb);
        let dzb = if grad.is_some() {
            Some(dev.scratch::<u16>(chunk * vocab)?)
        } else {
            None
        };
        let dzp = dzb.as_ref().map_or(0, |b| dev.addr(b));
        let z = dev.scratch::<f32>(chunk * vocab)?;
        let zp = dev.addr(&z);
        let dhc = if grad.is_some() {
            Some(dev.scratch::<f32>(chunk * d)?)
        } else {
            None
        };
        for c0 in (0..nt).step_by(chunk) {
            let rc = chunk.min(nt - c0);
            dev.gather_rows((hptr, at(rp, c0), hbp), rc, d, true)?;
            // z (rc, V) = h · Wᵀ.
            let fwd = Gemm {
                a: hbp,
                b: wp,
                c: zp,
                m: rc,
                n: vocab,
                k: d,
                ta: false,
                tb: true,
                lda: d,
                ldb: d,
                alpha: 1.0,
                accumulate: false,
            };
            dev.gemm_bf16(&fwd)?;
            let gpc = if gp == 0 { 0 } else { at(gp, c0) };
            dev.head_rows(
                zp,
                (rc, vocab),
                at(tp, c0),
                gpc,
                cap,
                (at(lp, c0), at(hp, c0)),
                (dzp, 0),
            )?;
            if let (Some(dh), Some(dhc)) = (dh.as_ref(), dhc.as_ref()) {
                // dh (rc, D) = dz · W.
                let back = Gemm {
                    a: dzp,
                    b: wp,
                    c: dev.addr(dhc),
                    m: rc,
                    n: d,
                    k: vocab,
                    ta: false,
                    tb: false,
                    lda: vocab,
                    ldb: d,
                    alpha: 1.0,
                    accumulate: false,
                };
                dev.gemm_bf16(&back)?;
                dev.scatter_rows(dev.addr(dhc), at(rp, c0), ptr(dh, "lm head")?, rc, d)?;
            }
        }
    } else {
        // No cuBLAS: the inference product for the logits and our f32 backward, chunk by chunk.
        for c0 in (0..nt).step_by(chunk) {
            let rc = chunk.min(nt - c0);
            let x = be.out(&[rc, d])?;
            dev.gather_rows((hptr, at(rp, c0), ptr(&x, "lm head")?), rc, d, false)?;
            let zt = be.linear(&x, w, None)?;
            let gpc = if gp == 0 { 0 } else { at(gp, c0) };
            let zc = ptr(&zt, "lm head")?;
            let dz = match grad {
                Some(_) => Some(be.out(&[rc, vocab])?),
                None => None,
            };
            let dzf = dz
                .as_ref()
                .map(|t| ptr(t, "lm head"))
                .transpose()?
                .unwrap_or(0);
            dev.head_rows(
                zc,
                (rc, vocab),
                at(tp, c0),
                gpc,
                cap,
                (at(lp, c0), at(hp, c0)),
                (0, dzf),
            )?;
            if let (Some(dh), Some(dz)) = (dh.as_ref(), dz.as_ref()) {
                let dhc = be.linear_backward_input(dz, w)?;
                dev.scatter_rows(
                    ptr(&dhc, "lm head")?,
                    at(rp, c0),
                    ptr(dh, "lm head")?,
                    rc,
                    d,
                )?;
            }
        }
    }
    let lv = dev.read(&logp_d)?;
    let hv = dev.read(&hit_d)?;
    for (i, &r) in rows.iter().enumerate() {
        logp[r as usize] = lv[i];
        hit[r as usize] = hv[i] != 0;
    }
    // Every row of dh is written: by the scatter, or by `zeros` for rows without a target.
    Ok(HeadOut { logp, hit, dh })
}
