//! Llama family block (Llama 2/3, SmolLM, Mistral; Qwen2 adds q/k/v bias, Qwen3 q/k RMSNorm —
//! both handled by `Attention` from the config): pre-norm attention and pre-norm SiLU MLP, the
//! MLP routed experts where the config says (Mixtral, Qwen3-MoE).
//! Reference: transformers' `modeling_llama.py` / `modeling_qwen2.py` / `modeling_qwen3.py` /
//! `modeling_mixtral.py` / `modeling_qwen3_moe.py`. The same block runs Phi-3 (fused products
//! split on load by `Attention` and `Mlp`), SmolLM3 (its no-RoPE layers rotate nothing) and
//! Granite and MiniCPM (each half's output scaled by `residual_multiplier`, MiniCPM's
//! `scale_depth / sqrt(layers)`, before the residual sum).
//! Reference: `modeling_phi3.py` / `modeling_smollm3.py` / `modeling_granite.py` /
//! `modeling_minicpm.py`. GPT-OSS too: its sinks, biases and YaRN live in `Attention`, its
//! router bias, expert biases and clamped SwiGLU in `MoeMlp` (`modeling_gpt_oss.py`).

use hf2q_tensor::op::{PreNorm, RopeParams};
use hf2q_tensor::Tensor;

use super::{
    attention_linears, attention_linears_mut, attention_mlp_linears, attention_mlp_linears_mut,
    downcast, Block, DenseLlama, Saved,
};
use crate::config::ModelConfig;
use crate::kv_cache::SeqRef;
use crate::layers::attention::{scale_tensor, Attention, AttentionSaved};
use crate::layers::linear::Linear;
use crate::layers::lora::{LoraGrads, TrainCtx};
use crate::layers::mlp::MlpSaved;
use crate::layers::moe::Ffn;
use crate::layers::served::Fwd;
use crate::source::WeightSource;
use crate::Result;

pub struct LlamaBlock {
    /// (D)
    attn_norm: Vec<f32>,
    attn: Attention,
    /// (D)
    mlp_norm: Vec<f32>,
    mlp: Ffn,
    eps: f32,
    /// Multiplier of each half's output (Granite; 1.0 elsewhere).
    residual_scale: f32,
}

impl LlamaBlock {
    pub fn load(
        src: &WeightSource,
        cfg: &ModelConfig,
        i: usize,
        rope: RopeParams,
    ) -> Result<LlamaBlock> {
        let p = format!("model.layers.{i}");
        let window = if cfg.sliding_layers[i] {
            cfg.sliding_window
        } else {
            None
        };
        Ok(LlamaBlock {
            attn_norm: src.vector(&format!("{p}.input_layernorm.weight"))?,
            attn: Attention::load(src, cfg, &p, rope, window)?,
            mlp_norm: src.vector(&format!("{p}.post_attention_layernorm.weight"))?,
            mlp: Ffn::load(src, cfg, &p, i)?,
            eps: cfg.rms_eps,
            residual_scale: cfg.residual_scale,
        })
    }
}

impl Block for LlamaBlock {
    fn rope(&self) -> Option<&RopeParams> {
        Some(&self.attn.rope)
    }
    fn forward(&self, cx: &Fwd, x: &mut Tensor, seqs: &mut [SeqRef<'_>]) -> Result<()> {
        let (eps, offset) = (self.eps, 0.0);
        if self.residual_scale != 1.0 {
            // x += s · attn(norm(x)); x += s · mlp(norm(x)).
            let (be, s) = (cx.be, self.residual_scale);
            let h = be.rms_norm(x, &self.attn_norm, eps, offset)?;
            let mut a = self.attn.forward(cx, &h, seqs)?;
            scale_tensor(be, &mut a, s)?;
            be.add_assign(x, &a)?;
            let h = be.rms_norm(x, &self.mlp_norm, eps, offset)?;
            let mut m = self.mlp.forward(cx, &h)?;
            scale_tensor(be, &mut m, s)?;
            return Ok(be.add_assign(x, &m)?);
        }
        let attn_norm = PreNorm {
            w: &self.attn_norm,
            eps,
            offset,
        };
        self.attn.forward_residual(cx, attn_norm, seqs, x)?;
        let mlp_norm = PreNorm {
            w: &self.mlp_norm,
            eps,
            offset,
        };
        self.mlp.forward_residual(cx, mlp_norm, x)
    }

    fn forward_train(&self, cx: &TrainCtx, x: &Tensor) -> Result<(Tensor, Saved)> {
        let be = cx.be;
        let mlp = self.mlp.dense()?;
        let h1 = be.rms_norm(x, &self.attn_norm, self.eps, 0.0)?;
        // The sums are written into the halves' outputs, never into `x` or `x1`: both are kept
        // for the backward, and a device tensor's clone shares its buffer.
        let s = self.residual_scale;
        let (mut x1, sa) = self.attn.forward_train(cx, &h1)?;
        if s != 1.0 {
            be.scale(&mut x1, s)?;
        }
        be.add_assign(&mut x1, x)?;
        let h2 = be.rms_norm(&x1, &self.mlp_norm, self.eps, 0.0)?;
        let (mut x2, sm) = mlp.forward_train(cx, &h2)?;
        if s != 1.0 {
            be.scale(&mut x2, s)?;
        }
        be.add_assign(&mut x2, &x1)?;
        Ok((
            x2,
            Box::new(LlamaSaved {
                h1,
                x1,
                h2,
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
        let be = cx.be;
        let s = downcast::<LlamaSaved>(saved)?;
        // x2 = x1 + r·mlp(norm(x1)); x1 = x + r·attn(norm(x)).
        let r = self.residual_scale;
        let scaled = |d: &Tensor| -> Result<Tensor> {
            let mut d = d.clone();
            if r != 1.0 {
                // A new tensor: a device tensor's clone shares its buffer.
                d = be.rows(&d, 0, d.dims2().0)?;
                be.scale(&mut d, r)?;
            }
            Ok(d)
        };
        let dh2 = self
            .mlp
            .dense()?
            .backward(cx, &s.h2, &s.mlp, &scaled(&dy)?, grads)?;
        let mut dx1 = dy;
        be.add_assign(
            &mut dx1,
            &be.rms_norm_backward(&s.x1, &self.mlp_norm, self.eps, 0.0, &dh2)?,
        )?;
        let dh1 = self
            .attn
            .backward(cx, &s.h1, &s.attn, &scaled(&dx1)?, grads)?;
        let mut dx = dx1;
        be.add_assign(
            &mut dx,
            &be.rms_norm_backward(x, &self.attn_norm, self.eps, 0.0, &dh1)?,
        )?;
        Ok(dx)
    }

    fn dense_llama(&self) -> Option<DenseLlama<'_>> {
        match &self.mlp {
            Ffn::Dense(mlp) if self.residual_scale == 1.0 => Some(DenseLlama {
                attn_norm: &self.attn_norm,
                attn: &self.attn,
                mlp_norm: &self.mlp_norm,
                mlp,
                eps: self.eps,
            }),
            _ => None,
        }
    }

    /// A routed layer's products are its attention's alone (adapters do not reach experts).
    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        match &self.mlp {
            Ffn::Dense(m) => attention_mlp_linears(&self.attn, m),
            Ffn::Routed(_) => attention_linears(&self.attn),
        }
    }
    fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        match &mut self.mlp {
            Ffn::Dense(m) => attention_mlp_linears_mut(&mut self.attn, m),
            Ffn::Routed(_) => attention_linears_mut(&mut self.attn),
        }
    }
}

/// What [`LlamaBlock::forward_train`] keeps: the normed inputs of both halves `h1`, `h2` and
/// the residual between them `x1`, `(N, D)` each.
struct LlamaSaved {
    h1: Tensor,
    x1: Tensor,
    h2: Tensor,
    attn: AttentionSaved,
    mlp: MlpSaved,
}
