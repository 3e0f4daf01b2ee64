//! Llama family block (Llama 2/3, SmolLM, Mistral; Qwen2 adds q/k/v bias, Qwen3 q/k RMSNorm —
//! both handled by `Attention` from the config): pre-norm attention and pre-norm SiLU MLP.
//! Reference: transformers' `modeling_llama.py` / `modeling_qwen2.py` / `modeling_qwen3.py`.

use hf2q_tensor::op::{Backend, PreNorm, RopeParams};
use hf2q_tensor::Tensor;

use super::Block;
use crate::config::ModelConfig;
use crate::kv_cache::SeqRef;
use crate::layers::{attention::Attention, mlp::Mlp};
use crate::source::WeightSource;
use crate::Result;

pub struct LlamaBlock {
    /// (D)
    attn_norm: Vec<f32>,
    attn: Attention,
    /// (D)
    mlp_norm: Vec<f32>,
    mlp: Mlp,
    eps: f32,
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
            mlp: Mlp::load(src, &p, cfg.activation)?,
            eps: cfg.rms_eps,
        })
    }
}

impl Block for LlamaBlock {
    fn forward(&self, be: &dyn Backend, x: &mut Tensor, seqs: &mut [SeqRef<'_>]) -> Result<()> {
        let (eps, offset) = (self.eps, 0.0);
        let attn_norm = PreNorm {
            w: &self.attn_norm,
            eps,
            offset,
        };
        self.attn.forward_residual(be, attn_norm, seqs, x)?;
        let mlp_norm = PreNorm {
            w: &self.mlp_norm,
            eps,
            offset,
        };
        self.mlp.forward_residual(be, mlp_norm, x)
    }
}
