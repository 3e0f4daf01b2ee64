//! Gemma 3 block: "sandwich" norms (pre and post around both attention and MLP), (1+w) RMSNorm
//! in checkpoint layout (the offset lives in the config: GGUF already added it), q/k RMSNorm,
//! GELU-tanh MLP, sliding-window local layers with their own RoPE base.
//! Reference: transformers' `modeling_gemma3.py` (`Gemma3DecoderLayer`).

use hf2q_tensor::op::{Backend, RopeParams};
use hf2q_tensor::Tensor;

use super::Block;
use crate::config::ModelConfig;
use crate::kv_cache::SeqRef;
use crate::layers::{attention::Attention, mlp::Mlp};
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
    fn forward(&self, be: &dyn Backend, x: &mut Tensor, seqs: &mut [SeqRef<'_>]) -> Result<()> {
        let h = be.rms_norm(x, &self.input_norm, self.eps, self.offset)?;
        let a = self.attn.forward(be, &h, seqs)?;
        let a = be.rms_norm(&a, &self.post_attn_norm, self.eps, self.offset)?;
        be.add_assign(x, &a)?;
        let h = be.rms_norm(x, &self.pre_ffn_norm, self.eps, self.offset)?;
        let m = self.mlp.forward(be, &h)?;
        let m = be.rms_norm(&m, &self.post_ffn_norm, self.eps, self.offset)?;
        be.add_assign(x, &m)?;
        Ok(())
    }
}
