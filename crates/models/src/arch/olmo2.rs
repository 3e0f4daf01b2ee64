//! OLMo 2 block: no pre-norms; RMSNorm of the attention's output and of the MLP's output
//! before each joins the residual, q/k RMSNorm over the whole projection (handled by
//! `Attention` from the config), SiLU MLP.
//! Reference: transformers' `modeling_olmo2.py` (`Olmo2DecoderLayer`).

use hf2q_tensor::op::RopeParams;
use hf2q_tensor::Tensor;

use super::{attention_mlp_linears, attention_mlp_linears_mut, downcast, Block, Saved};
use crate::config::ModelConfig;
use crate::kv_cache::SeqRef;
use crate::layers::attention::{Attention, AttentionSaved};
use crate::layers::linear::Linear;
use crate::layers::lora::{LoraGrads, TrainCtx};
use crate::layers::mlp::{Mlp, MlpSaved};
use crate::layers::served::Fwd;
use crate::source::WeightSource;
use crate::Result;

pub struct Olmo2Block {
    /// (D) each.
    post_attn_norm: Vec<f32>,
    post_ffn_norm: Vec<f32>,
    attn: Attention,
    mlp: Mlp,
    eps: f32,
}

impl Olmo2Block {
    pub fn load(
        src: &WeightSource,
        cfg: &ModelConfig,
        i: usize,
        rope: RopeParams,
    ) -> Result<Olmo2Block> {
        let p = format!("model.layers.{i}");
        let v = |n: &str| src.vector(&format!("{p}.{n}.weight"));
        let window = if cfg.sliding_layers[i] {
            cfg.sliding_window
        } else {
            None
        };
        Ok(Olmo2Block {
            post_attn_norm: v("post_attention_layernorm")?,
            post_ffn_norm: v("post_feedforward_layernorm")?,
            attn: Attention::load(src, cfg, &p, rope, window)?,
            mlp: Mlp::load(src, &p, cfg.activation)?,
            eps: cfg.rms_eps,
        })
    }
}

impl Block for Olmo2Block {
    fn rope(&self) -> Option<&RopeParams> {
        Some(&self.attn.rope)
    }
    fn forward(&self, cx: &Fwd, x: &mut Tensor, seqs: &mut [SeqRef<'_>]) -> Result<()> {
        let be = cx.be;
        let a = self.attn.forward(cx, x, seqs)?;
        let a = be.rms_norm(&a, &self.post_attn_norm, self.eps, 0.0)?;
        be.add_assign(x, &a)?;
        let m = self.mlp.forward(cx, x)?;
        let m = be.rms_norm(&m, &self.post_ffn_norm, self.eps, 0.0)?;
        be.add_assign(x, &m)?;
        Ok(())
    }

    fn forward_train(&self, cx: &TrainCtx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (be, eps) = (cx.be, self.eps);
        // The sums are written into new tensors, never into `x` or `x1`: both are kept for the
        // backward, and a device tensor's clone shares its buffer.
        let (a, sa) = self.attn.forward_train(cx, x)?;
        let mut x1 = be.rms_norm(&a, &self.post_attn_norm, eps, 0.0)?;
        be.add_assign(&mut x1, x)?;
        let (m, sm) = self.mlp.forward_train(cx, &x1)?;
        let mut x2 = be.rms_norm(&m, &self.post_ffn_norm, eps, 0.0)?;
        be.add_assign(&mut x2, &x1)?;
        Ok((
            x2,
            Box::new(Olmo2Saved {
                a,
                x1,
                m,
                attn: sa,
                mlp: sm,
            }),
        ))
    }

    fn backward(
        &self,
        cx: &TrainCtx,
        x: &Tensor,
        saved: Saved,
        dy: Tensor,
        grads: &mut LoraGrads,
    ) -> Result<Tensor> {
        let (be, eps) = (cx.be, self.eps);
        let s = downcast::<Olmo2Saved>(saved)?;
        // x2 = x1 + norm_ffn(mlp(x1)); x1 = x + norm_attn(attn(x)).
        let dm = be.rms_norm_backward(&s.m, &self.post_ffn_norm, eps, 0.0, &dy)?;
        let mut dx1 = dy;
        be.add_assign(&mut dx1, &self.mlp.backward(cx, &s.x1, &s.mlp, &dm, grads)?)?;
        let da = be.rms_norm_backward(&s.a, &self.post_attn_norm, eps, 0.0, &dx1)?;
        let mut dx = dx1;
        be.add_assign(&mut dx, &self.attn.backward(cx, x, &s.attn, &da, grads)?)?;
        Ok(dx)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        attention_mlp_linears(&self.attn, &self.mlp)
    }
    fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        attention_mlp_linears_mut(&mut self.attn, &mut self.mlp)
    }
}

/// What [`Olmo2Block::forward_train`] keeps, `(N, D)` each: the attention's output `a`, the
/// residual between the halves `x1` (the MLP's input) and the MLP's output `m` (the norms'
/// inputs).
struct Olmo2Saved {
    a: Tensor,
    x1: Tensor,
    m: Tensor,
    attn: AttentionSaved,
    mlp: MlpSaved,
}
