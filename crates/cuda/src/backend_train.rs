//! [`TrainBackend`] for [`CudaBackend`], and its dense f32 products ([`Backend::matmul`]): the
//! training op set on one GPU over the launchers of `train.rs`. Shapes are checked here
//! (with the CPU reference's own checks where it has them), pointers handed down.
//!
//! Precision (the budget of each op against the CPU reference, `cpu/train`):
//! - f32 throughout: RoPE, RMSNorm and gated-activation backward, dropout (the same mask bit for
//!   bit), add_scaled / scale / AdamW (bit for bit: no fused multiply-adds), sum_squares (f64),
//!   `matmul` (cuBLAS sgemm without TF32, or our f32 kernels).
//! - f16 operands, f32 sums: `linear_low_rank` (x, u, the weight and B rounded to f16, as the
//!   inference products' one-pass mode rounds them: 2^-11 relative each).
//! - bf16 operands, f32 sums (the products that dominate a step, on tensor cores):
//!   `linear_backward_input` and its low-rank form (dy, du, A and the dequantized weight
//!   rounded to bf16), attention forward
//!   and backward (q, k, v, dout, P and dS rounded to bf16 on the Dh = 64 / 128 kernels; other
//!   head widths run f32 kernels), `lm_head_logprobs` (h, the weight and the logits' gradient
//!   in bf16; logits and the softmax in f32). Each rounding is 2^-9 relative: about 1e-3 to
//!   1e-2 relative on the outputs, PEFT's bf16 budget.
//!
//! Not here: the inference ops (`backend.rs`) and the kernels' own layout (`cuda/`).

mod head;
mod lowrank;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use crate::backend::CudaBackend;
use crate::train::{AdamArgs, AttnArgs, Gemm};
use crate::CudaDev;
use hf2q_tensor::op::{same_shape, Backend, GateAct, MatmulSpec, RopeParams};
use hf2q_tensor::tensor::DeviceSpan;
use hf2q_tensor::train_op::{
    check_attention, AdamCoefficients, AdamStep, AttentionGrads, AttentionOut, HeadOut, SeqLayout,
    TrainAttention, TrainBackend,
};
use hf2q_tensor::{Error, QTensor, Result, Tensor};

/// Logits held at once by `lm_head_logprobs` (f32, 256 MiB; with the gradient another half of
/// that as bf16): 523 rows of a 128256 vocabulary, enough rows for the tensor cores.
const HEAD_CHUNK_LOGITS: usize = 64 << 20;

/// Most weight values dequantized at once by `linear_backward_input` (bf16, 256 MiB): every
/// matrix of an 8B model in one piece.
const WEIGHT_CHUNK_VALUES: usize = 128 << 20;

/// The multiple the depth of a product with an appended low-rank term is padded to (with zero
/// columns): 8, 64 and 128 measured within 2 % of each other on the H200 (cuda/NOTES.md), 64
/// the best by a little.
pub(crate) const LOW_RANK_ALIGN: usize = 64;

/// A batch layout on the device: `seq (N, 2)` (start, end) of each row's sequence, uploaded once
/// per [`SeqLayout`] into its `device` slot.
struct DeviceLayout {
    /// The device it lives on (the address of its `CudaDev`).
    dev: usize,
    seq: CudaSlice<i32>,
}

/// The device address of a tensor's values.
pub(crate) fn ptr(x: &Tensor, what: &str) -> Result<u64> {
    x.device_span().map(|s| s.ptr).ok_or_else(|| {
        Error::Msg(format!(
            "cuda {what}: the input is a host tensor (expected a device tensor)"
        ))
    })
}

impl CudaBackend {
    pub(crate) fn dev(&self) -> &CudaDev {
        self.device()
    }

    /// A new output tensor: uninitialised (every op writes all of its output), the arena's next
    /// piece while capturing, NaN-filled first when [`CudaBackend::set_poison_outputs`] is on.
    pub(crate) fn out(&self, shape: &[usize]) -> Result<Tensor> {
        if self.capturing() {
            return self.alloc(shape);
        }
        let n: usize = shape.iter().product();
        let buf = self.dev().scratch::<f32>(n)?;
        let p = self.dev().addr(&buf);
        if self.poison.load(Relaxed) {
            self.dev().memset(p, 0xff, n * 4)?;
        }
        Tensor::on_device(
            shape,
            DeviceSpan {
                ptr: p,
                len: n,
                owner: Arc::new(buf),
            },
        )
    }

    /// The layout's `(start, end)` pairs on this device, uploaded on first use. A layout
    /// uploaded to another device is uploaded again for this call (`held` keeps it alive).
    fn layout(&self, l: &SeqLayout, held: &mut Option<CudaSlice<i32>>) -> Result<u64> {
        let id = Arc::as_ptr(self.device()) as usize;
        if let Some(d) = l.device.get() {
            if let Some(dl) = d.downcast_ref::<DeviceLayout>().filter(|d| d.dev == id) {
                return Ok(self.dev().addr(&dl.seq));
            }
            let seq = self.upload_layout(l)?;
            let p = self.dev().addr(&seq);
            *held = Some(seq);
            return Ok(p);
        }
        let seq = self.upload_layout(l)?;
        let _ = l.device.set(Arc::new(DeviceLayout { dev: id, seq }));
        self.layout(l, held)
    }

    fn upload_layout(&self, l: &SeqLayout) -> Result<CudaSlice<i32>> {
        let n = l.rows();
        if n > i32::MAX as usize {
            return Err(Error::Shape(format!("cuda: a batch of {n} rows")));
        }
        let mut v = Vec::with_capacity(2 * n);
        for w in l.starts().windows(2) {
            for _ in w[0]..w[1] {
                v.extend([w[0] as i32, w[1] as i32]);
            }
        }
        self.dev().upload(&v)
    }

    fn attn_args(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seq: u64,
        n: usize,
        a: &TrainAttention,
    ) -> Result<AttnArgs> {
        let (h, hkv, dh) = (a.p.n_heads, a.p.n_kv_heads, a.p.head_dim);
        if dh > 256 {
            return Err(Error::Shape(format!(
                "cuda attention: head width {dh} (at most 256)"
            )));
        }
        if a.softcap.is_some_and(|c| !(c > 0.0)) {
            return Err(Error::Shape(format!("attention: soft cap {:?}", a.softcap)));
        }
        let window = match a.p.window {
            Some(w) => i32::try_from(w).unwrap_or(i32::MAX),
            None => 0,
        };
        Ok(AttnArgs {
            q: ptr(q, "attention")?,
            k: ptr(k, "attention")?,
            v: ptr(v, "attention")?,
            seq,
            n,
            heads: h,
            kv_heads: hkv,
            head_dim: dh,
            scale: a.p.scale,
            window,
            cap: a.softcap.unwrap_or(0.0),
        })
    }

    /// `dx (n, C) = dy (n, R) · W (R, C)` on bf16 operands (cuBLAS), the weight dequantized in
    /// chunks of rows (a BF16 weight is its own operand); `Ok(false)` without cuBLAS.
    pub(crate) fn backward_input_bf16(
        &self,
        dy: u64,
        w: &QTensor,
        dx: u64,
        n: usize,
    ) -> Result<bool> {
        if self.dev().train_blas()?.is_none() {
            return Ok(false);
        }
        let dw = self.weight(w)?;
        let (r, c) = (w.rows, w.cols);
        let dev = self.dev();
        let dyb = dev.scratch::<u16>(n * r)?;
        let dyp = dev.addr(&dyb);
        dev.to_bf16(dy, dyp, n * r, 1.0)?;
        let direct = dw.kind() == "bf16";
        let chunk = if direct {
            r
        } else {
            (WEIGHT_CHUNK_VALUES / c.max(1)).clamp(1, r)
        };
        let wbuf = if direct {
            None
        } else {
            Some(dev.scratch::<u16>(chunk * c)?)
        };
        for r0 in (0..r).step_by(chunk) {
            let rc = chunk.min(r - r0);
            let wp = match &wbuf {
                Some(b) => {
                    let p = dev.addr(b);
                    dev.dequantize_rows(&dw, p, c, (r0, rc), false)?;
                    p
                }
                None => dw.args(dev).data,
            };
            let g = Gemm {
                a: dyp + (r0 * 2) as u64,
                b: wp,
                c: dx,
                m: n,
                n: c,
                k: rc,
                ta: false,
                tb: false,
                lda: r,
                ldb: c,
                alpha: 1.0,
                accumulate: r0 > 0,
            };
            dev.gemm_bf16(&g)?;
        }
        Ok(true)
    }

    /// [`CudaBackend::backward_input_bf16`] in f32 on our own kernels (no cuBLAS, or tests).
    fn backward_input_f32(&self, dy: u64, w: &QTensor, dx: u64, n: usize) -> Result<()> {
        let dw = self.weight(w)?;
        let (r, c) = (w.rows, w.cols);
        let dev = self.dev();
        let chunk = (WEIGHT_CHUNK_VALUES / 2 / c.max(1)).clamp(1, r);
        let wbuf = dev.scratch::<f32>(chunk * c)?;
        let wp = dev.addr(&wbuf);
        for r0 in (0..r).step_by(chunk) {
            let rc = chunk.min(r - r0);
            dev.dequantize_rows(&dw, wp, c, (r0, rc), true)?;
            let g = Gemm {
                a: dy + (r0 * 4) as u64,
                b: wp,
                c: dx,
                m: n,
                n: c,
                k: rc,
                ta: false,
                tb: false,
                lda: r,
                ldb: c,
                alpha: 1.0,
                accumulate: r0 > 0,
            };
            dev.gemm_f32(&g)?;
        }
        Ok(())
    }
}

/// [`Backend::matmul`] on the device.
pub(crate) fn matmul(be: &CudaBackend, a: &Tensor, b: &Tensor, spec: MatmulSpec) -> Result<Tensor> {
    let (m, k, n) = spec.dims(a, b)?;
    let out = be.out(&[m, n])?;
    let ptrs = (ptr(a, "matmul")?, ptr(b, "matmul")?, ptr(&out, "matmul")?);
    be.dev().gemm_f32(&Gemm::dense(
        ptrs,
        (m, k, n),
        spec.ta,
        spec.tb,
        spec.alpha,
        false,
    ))?;
    Ok(out)
}

/// [`Backend::matmul_acc`] on the device.
pub(crate) fn matmul_acc(
    be: &CudaBackend,
    out: &mut Tensor,
    a: &Tensor,
    b: &Tensor,
    spec: MatmulSpec,
) -> Result<()> {
    let (m, k, n) = spec.dims(a, b)?;
    if out.dims2() != (m, n) || out.len() != m * n {
        return Err(Error::Shape(format!(
            "matmul_acc: output is {:?}, the product ({m}, {n})",
            out.shape()
        )));
    }
    let ptrs = (ptr(a, "matmul")?, ptr(b, "matmul")?, ptr(out, "matmul")?);
    be.dev().gemm_f32(&Gemm::dense(
        ptrs,
        (m, k, n),
        spec.ta,
        spec.tb,
        spec.alpha,
        true,
    ))
}

impl TrainBackend for CudaBackend {
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
        layout.check(x, "rope")?;
        let n = x.dims2().0;
        let dh = hf2q_tensor::op::check_rope(x, n_heads, p)?;
        if n == 0 || p.dims == 0 {
            return Ok(());
        }
        let table = self.rope_table(p)?;
        let mut held = None;
        let seq = self.layout(layout, &mut held)?;
        self.dev()
            .rope_rows(ptr(x, "rope")?, (n, n_heads, dh), seq, &table, inverse)
    }

    fn attention_train(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        layout: &SeqLayout,
        a: &TrainAttention,
    ) -> Result<AttentionOut> {
        let (h, _, dh) = check_attention(q, k, v, layout, a)?;
        let n = layout.rows();
        let mut held = None;
        let seq = self.layout(layout, &mut held)?;
        let args = self.attn_args(q, k, v, seq, n, a)?;
        let out = self.out(&[n, h * dh])?;
        let lse = self.out(&[n, h])?;
        self.dev()
            .attention_train(&args, ptr(&out, "attention")?, ptr(&lse, "attention")?)?;
        Ok(AttentionOut { out, lse })
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
        let (h, hkv, dh) = check_attention(q, k, v, layout, a)?;
        let n = layout.rows();
        if dout.shape() != fwd.out.shape()
            || fwd.out.dims2() != (n, h * dh)
            || fwd.lse.dims2() != (n, h)
        {
            return Err(Error::Shape(format!(
                "attention backward: dout {:?}, out {:?}, lse {:?}",
                dout.shape(),
                fwd.out.shape(),
                fwd.lse.shape()
            )));
        }
        let mut held = None;
        let seq = self.layout(layout, &mut held)?;
        let args = self.attn_args(q, k, v, seq, n, a)?;
        let dq = self.out(&[n, h * dh])?;
        let dk = self.out(&[n, hkv * dh])?;
        let dv = self.out(&[n, hkv * dh])?;
        let what = "attention backward";
        self.dev().attention_backward(
            &args,
            (ptr(&fwd.out, what)?, ptr(&fwd.lse, what)?, ptr(dout, what)?),
            (ptr(&dq, what)?, ptr(&dk, what)?, ptr(&dv, what)?),
        )?;
        Ok(AttentionGrads { dq, dk, dv })
    }

    fn rms_norm_backward(
        &self,
        x: &Tensor,
        w: &[f32],
        eps: f32,
        offset: f32,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let (rows, c) = hf2q_tensor::train_op::check_norm_backward(x, w, dy)?;
        let dx = self.out(x.shape())?;
        if x.is_empty() {
            return Ok(dx);
        }
        let wd = self.vector(w)?;
        let what = "rms_norm_backward";
        let ptrs = (
            ptr(x, what)?,
            self.dev().addr(&wd),
            ptr(dy, what)?,
            ptr(&dx, what)?,
        );
        self.dev().rms_norm_backward(ptrs, rows, c, eps, offset)?;
        Ok(dx)
    }

    fn gated_act_backward(
        &self,
        gate: &Tensor,
        up: &Tensor,
        dy: &Tensor,
        act: GateAct,
    ) -> Result<(Tensor, Tensor)> {
        crate::backend::refuse_act(act)?;
        same_shape(gate, up, "gated_act_backward")?;
        same_shape(gate, dy, "gated_act_backward")?;
        let dg = self.out(gate.shape())?;
        let du = self.out(gate.shape())?;
        if !gate.is_empty() {
            let what = "gated_act_backward";
            let ptrs = (
                ptr(gate, what)?,
                ptr(up, what)?,
                ptr(dy, what)?,
                ptr(&dg, what)?,
                ptr(&du, what)?,
            );
            self.dev()
                .gated_act_backward(ptrs, gate.len(), act == GateAct::GeluTanh)?;
        }
        Ok((dg, du))
    }

    fn linear_backward_input(&self, dy: &Tensor, w: &QTensor) -> Result<Tensor> {
        let (n, r) = dy.dims2();
        if r != w.rows {
            return Err(Error::Shape(format!(
                "linear backward '{}': gradient has {r} features, the weight {} rows",
                w.name, w.rows
            )));
        }
        let dx = self.out(&[n, w.cols])?;
        if n == 0 {
            return Ok(dx);
        }
        let (dyp, dxp) = (ptr(dy, "linear backward")?, ptr(&dx, "linear backward")?);
        if !self.backward_input_bf16(dyp, w, dxp, n)? {
            self.backward_input_f32(dyp, w, dxp, n)?;
        }
        Ok(dx)
    }

    fn linear_low_rank(
        &self,
        x: &Tensor,
        w: &QTensor,
        bias: Option<&[f32]>,
        u: &Tensor,
        b: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        if let Some(y) = lowrank::forward(self, x, w, bias, u, b, scale)? {
            return Ok(y);
        }
        let mut y = self.linear(x, w, bias)?;
        self.matmul_acc(&mut y, u, b, MatmulSpec::NT.scaled(scale))?;
        Ok(y)
    }

    fn linear_backward_input_low_rank(
        &self,
        dy: &Tensor,
        w: &QTensor,
        du: &Tensor,
        a: &Tensor,
        scale: f32,
    ) -> Result<Tensor> {
        if let Some(dx) = lowrank::backward_input(self, dy, w, du, a, scale)? {
            return Ok(dx);
        }
        let mut dx = self.linear_backward_input(dy, w)?;
        self.matmul_acc(&mut dx, du, a, MatmulSpec::NN.scaled(scale))?;
        Ok(dx)
    }

    fn dropout(&self, x: &Tensor, p: f32, seed: u64) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::Shape(format!(
                "dropout probability {p} is not in [0, 1)"
            )));
        }
        if p == 0.0 || x.is_empty() {
            // A copy, as the CPU's: the caller may change the result in place.
            let y = self.rows(x, 0, x.dims2().0)?;
            return y.reshape(x.shape());
        }
        let out = self.out(x.shape())?;
        self.dev()
            .dropout(ptr(x, "dropout")?, ptr(&out, "dropout")?, x.len(), seed, p)?;
        Ok(out)
    }

    fn lm_head_logprobs(
        &self,
        h: &Tensor,
        w: &QTensor,
        targets: &[i32],
        softcap: Option<f32>,
        grad: Option<&[f32]>,
    ) -> Result<HeadOut> {
        head::lm_head_logprobs(self, h, w, targets, softcap, grad)
    }

    fn add_scaled(&self, x: &mut Tensor, y: &Tensor, alpha: f32) -> Result<()> {
        same_shape(x, y, "add_scaled")?;
        if x.is_empty() {
            return Ok(());
        }
        self.dev()
            .add_scaled(ptr(x, "add_scaled")?, ptr(y, "add_scaled")?, x.len(), alpha)
    }

    fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        if x.is_empty() {
            return Ok(());
        }
        self.dev().scale(ptr(x, "scale")?, x.len(), s)
    }

    fn sum_squares(&self, x: &Tensor) -> Result<f64> {
        if x.is_empty() {
            return Ok(0.0);
        }
        self.dev().sum_squares(ptr(x, "sum_squares")?, x.len())
    }

    fn zeros(&self, shape: &[usize]) -> Result<Tensor> {
        let t = self.alloc(shape)?;
        if self.capturing() && !t.is_empty() {
            self.dev().memset(ptr(&t, "zeros")?, 0, t.len() * 4)?;
        }
        Ok(t)
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
        if param.is_empty() {
            return Ok(());
        }
        let c = AdamCoefficients::new(s);
        let args = AdamArgs {
            decay: c.decay,
            beta1: c.beta1,
            one_minus_beta1: 1.0 - c.beta1,
            beta2: c.beta2,
            one_minus_beta2: 1.0 - c.beta2,
            step_size: c.step_size,
            bias2_sqrt: c.bias2_sqrt,
            eps: c.eps,
        };
        let ptrs = (
            ptr(param, "adamw")?,
            ptr(grad, "adamw")?,
            ptr(m, "adamw")?,
            ptr(v, "adamw")?,
        );
        self.dev().adamw(ptrs, param.len(), args)
    }
}
