//! Gemma 3 block: "sandwich" norms (pre and post around both attention and MLP), (1+w) RMSNorm
//! in checkpoint layout (the offset lives in the config: GGUF already added it), q/k RMSNorm,
//! GELU-tanh MLP, sliding-window local layers with their own RoPE base.
//! Reference: transformers' `modeling_gemma3.py` (`Gemma3DecoderLayer`).

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

pub struct Gemma3Block {
    /// (D) each.
    input_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    pre_ffn_norm: Vec<f32>,
    post_ffn_norm: Vec<f32>,
    attn: Attention,
    mlp: Mlp,
    eps: f32,
    offset: f32,
}

impl Gemma3Block {
    pub fn load(
        src: &WeightSource,
        cfg: &ModelConfig,
        i: usize,
        rope: RopeParams,
    ) -> Result<Gemma3Block> {
        let p = format!("model.layers.{i}");
        let v = |n: &str| src.vector(&format!("{p}.{n}.weight"));
        let window = if cfg.sliding_layers[i] {
            cfg.sliding_window
        } else {
            None
        };
        Ok(Gemma3Block {
            input_norm: v("input_layernorm")?,
            post_attn_norm: v("post_attention_layernorm")?,
            pre_ffn_norm: v("pre_feedforward_layernorm")?,
            post_ffn_norm: v("post_feedforward_layernorm")?,
            attn: Attention::load(src, cfg, &p, rope, window)?,
            mlp: Mlp::load(src, &p, cfg.activation)?,
            eps: cfg.rms_eps,
            offset: cfg.norm_offset,
        })
    }
}

impl Block for Gemma3Block {
    fn rope(&self) -> Option<&RopeParams> {
        Some(&self.attn.rope)
    }
    fn forward(&self, cx: &Fwd, x: &mut Tensor, seqs: &mut [SeqRef<'_>]) -> Result<()> {
        let be = cx.be;
        let h = be.rms_norm(x, &self.input_norm, self.eps, self.offset)?;
        let a = self.attn.forward(cx, &h, seqs)?;
        let a = be.rms_norm(&a, &self.post_attn_norm, self.eps, self.offset)?;
        be.add_assign(x, &a)?;
        let h = be.rms_norm(x, &self.pre_ffn_norm, self.eps, self.offset)?;
        let m = self.mlp.forward(cx, &h)?;
        let m = be.rms_norm(&m, &self.post_ffn_norm, self.eps, self.offset)?;
        be.add_assign(x, &m)?;
        Ok(())
    }

    fn forward_train(&self, cx: &TrainCtx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (be, eps, off) = (cx.be, self.eps, self.offset);
        let h = be.rms_norm(x, &self.input_norm, eps, off)?;
        // The sums are written into new tensors, never into `x` or `x1`: both are kept for the
        // backward, and a device tensor's clone shares its buffer.
        let (a, sa) = self.attn.forward_train(cx, &h)?;
        let mut x1 = be.rms_norm(&a, &self.post_attn_norm, eps, off)?;
        be.add_assign(&mut x1, x)?;
        let h2 = be.rms_norm(&x1, &self.pre_ffn_norm, eps, off)?;
        let (m, sm) = self.mlp.forward_train(cx, &h2)?;
        let mut x2 = be.rms_norm(&m, &self.post_ffn_norm, eps, off)?;
        be.add_assign(&mut x2, &x1)?;
        Ok((
            x2,
            Box::new(Gemma3Saved {
                h,
                a,
                x1,
                h2,
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
        let (be, eps, off) = (cx.be, self.eps, self.offset);
        let s = downcast::<Gemma3Saved>(saved)?;
        // x2 = x1 + norm_post_ffn(mlp(norm_pre_ffn(x1)));
        // x1 = x + norm_post_attn(attn(norm_in(x))).
        let dm = be.rms_norm_backward(&s.m, &self.post_ffn_norm, eps, off, &dy)?;
        let dh2 = self.mlp.backward(cx, &s.h2, &s.mlp, &dm, grads)?;
        let mut dx1 = dy;
        be.add_assign(
            &mut dx1,
            &be.rms_norm_backward(&s.x1, &self.pre_ffn_norm, eps, off, &dh2)?,
        )?;
        let da = be.rms_norm_backward(&s.a, &self.post_attn_norm, eps, off, &dx1)?;
        let dh = self.attn.backward(cx, &s.h, &s.attn, &da, grads)?;
        let mut dx = dx1;
        be.add_assign(
            &mut dx,
            &be.rms_norm_backward(x, &self.input_norm, eps, off, &dh)?,
        )?;
        Ok(dx)
    }

    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        attention_mlp_linears(&self.attn, &self.mlp)
    }
    fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        attention_mlp_linears_mut(&mut self.attn, &mut self.mlp)
    }
}

/// What [`Gemma3Block::forward_train`] keeps, `(N, D)` each: the attention's normed input `h`
/// and output `a`, the residual between the halves `x1`, the MLP's normed input `h2` and its
/// output `m` (the post-norms' inputs).
struct Gemma3Saved {
    h: Tensor,
    a: Tensor,
    x1: Tensor,
    h2: Tensor,
    m: Tensor,
    attn: AttentionSaved,
    mlp: MlpSaved,
}
