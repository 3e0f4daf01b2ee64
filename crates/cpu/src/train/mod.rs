//! [`TrainBackend`] on the CPU: the reference of every training op (scalar f32, rayon over rows,
//! heads or sequences) and, for products, the `gemm` crate's packed kernels
//! ([`super::dense`]). The forward products of stored weights are `CpuBackend::linear`, on
//! whichever matmul path the backend is set to (the reference for parity tests, the SIMD
//! kernels for speed).

mod act;
pub(crate) mod attention;
pub mod head;
mod norm;
mod rope;

use rayon::prelude::*;

use super::dense::{self, RowSource};
use super::CpuBackend;
use hf2q_tensor::op::{same_shape, Backend, GateAct, RopeParams};
use hf2q_tensor::train_op::{
    dropout_keep, AdamCoefficients, AdamStep, AttentionGrads, AttentionOut, HeadOut, SeqLayout,
    TrainAttention, TrainBackend,
};
use hf2q_tensor::{Error, QTensor, Result, Tensor};

/// Rows of a weight as the fast path keeps them (its packed copy, whose original pages were
/// handed back), or as stored.
struct WeightRows<'a> {
    w: &'a QTensor,
    packed: Option<std::sync::Arc<super::kernels::Packed>>,
}

impl RowSource for WeightRows<'_> {
    fn dequantize_row(&self, r: usize, dst: &mut [f32]) -> Result<()> {
        match &self.packed {
            Some(p) => p.dequantize_row(r, dst),
            None => self.w.dequantize_row(r, dst),
        }
    }
}

impl TrainBackend for CpuBackend {
    fn as_backend(&self) -> &dyn Backend {
        self
    }

    fn rope_rows(
        &self,
        x: &mut Tensor,
        n_heads: usize,
        layout: &SeqLayout,
        p: &RopeParams,
        inverse: bool,
    ) -> Result<()> {
        rope::rope_rows(x, n_heads, layout, p, inverse)
    }

    fn attention_train(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        layout: &SeqLayout,
        a: &TrainAttention,
    ) -> Result<AttentionOut> {
        attention::attention_train(q, k, v, layout, a)
    }

    fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        fwd: &AttentionOut,
        dout: &Tensor,
        layout: &SeqLayout,
        a: &TrainAttention,
    ) -> Result<AttentionGrads> {
        attention::attention_backward(q, k, v, fwd, dout, layout, a)
    }

    fn rms_norm_backward(
        &self,
        x: &Tensor,
        w: &[f32],
        eps: f32,
        offset: f32,
        dy: &Tensor,
    ) -> Result<Tensor> {
        norm::rms_norm_backward(x, w, eps, offset, dy)
    }

    fn gated_act_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        dy: &Tensor,
        act: GateAct,
    ) -> Result<(Tensor, Tensor)> {
        act::gated_act_backward(gate, up, dy, act)
    }

    fn linear_backward_input(&self, dy: &Tensor, w: &QTensor) -> Result<Tensor> {
        let rows = WeightRows {
            w,
            packed: self.packed.existing(w),
        };
        dense::linear_backward_input(dy, w, &rows)
    }

    fn dropout(&self, x: &Tensor, p: f32, seed: u64) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::Shape(format!(
                "dropout probability {p} is not in [0, 1)"
            )));
        }
        if p == 0.0 {
            return Ok(x.clone());
        }
        let keep_scale = 1.0 / (1.0 - p);
        let d: Vec<f32> = x
            .data()
            .par_iter()
            .enumerate()
            .map(|(i, &v)| {
                if dropout_keep(seed, i as u64, p) {
                    v * keep_scale
                } else {
                    0.0
                }
            })
            .collect();
        Tensor::new(x.shape(), d)
    }

    fn lm_head_logprobs(
        &self,
        h: &Tensor,
        w: &QTensor,
        targets: &[i32],
        softcap: Option<f32>,
        grad: Option<&[f32]>,
    ) -> Result<HeadOut> {
        head::lm_head_chunked(
            h,
            w.rows,
            targets,
            softcap,
            grad,
            &|x| self.linear(x, w, None),
            &|dz| self.linear_backward_input(dz, w),
        )
    }

    fn add_scaled(&self, x: &mut Tensor, y: &Tensor, alpha: f32) -> Result<()> {
        same_shape(x, y, "add_scaled")?;
        x.data_mut()
            .par_iter_mut()
            .zip(y.data().par_iter())
            .for_each(|(a, b)| *a += alpha * b);
        Ok(())
    }

    fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        x.data_mut().par_iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        Ok(x.data().par_iter().map(|&v| v as f64 * v as f64).sum())
    }

    fn zeros(&self, shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::zeros(shape))
    }

    fn adamw(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        s: &AdamStep,
    ) -> Result<()> {
        same_shape(param, grad, "adamw")?;
        same_shape(param, m, "adamw")?;
        same_shape(param, v, "adamw")?;
        let c = AdamCoefficients::new(s);
        param
            .data_mut()
            .par_iter_mut()
            .zip(grad.data().par_iter())
            .zip(m.data_mut().par_iter_mut().zip(v.data_mut().par_iter_mut()))
            .for_each(|((p, &g), (mm, vv))| c.update(p, g, mm, vv));
        Ok(())
    }
}
