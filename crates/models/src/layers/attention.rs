//! Self-attention with grouped KV heads, optional q/k bias (Qwen2) and q/k RMSNorm (Qwen3,
//! Gemma 3), RoPE, optional sliding window, writing into the layer's KV cache.

use hf2q_tensor::cpu::CpuBackend;
use hf2q_tensor::op::{AttentionParams, Backend, RopeParams};
use hf2q_tensor::Tensor;

use crate::config::ModelConfig;
use crate::kv_cache::LayerKv;
use crate::layers::linear::Linear;
use crate::source::WeightSource;
use crate::Result;

pub struct Attention {
    /// (H*Dh, D)
    pub q: Linear,
    /// (Hkv*Dh, D)
    pub k: Linear,
    /// (Hkv*Dh, D)
    pub v: Linear,
    /// (D, H*Dh)
    pub o: Linear,
    /// (Dh) each, when the family normalises q and k per head.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub rope: RopeParams,
    pub params: AttentionParams,
    pub eps: f32,
    pub norm_offset: f32,
}

impl Attention {
    pub fn load(src: &WeightSource, cfg: &ModelConfig, prefix: &str, rope: RopeParams, window: Option<usize>) -> Result<Attention> {
        let bias = cfg.attention_bias;
        let norm = |n: &str| -> Result<Option<Vec<f32>>> {
            if cfg.qk_norm {
                Ok(Some(src.vector(&format!("{prefix}.self_attn.{n}.weight"))?))
            } else {
                Ok(None)
            }
        };
        Ok(Attention {
            q: Linear::load(src, &format!("{prefix}.self_attn.q_proj"), bias)?,
            k: Linear::load(src, &format!("{prefix}.self_attn.k_proj"), bias)?,
            v: Linear::load(src, &format!("{prefix}.self_attn.v_proj"), bias)?,
            o: Linear::load(src, &format!("{prefix}.self_attn.o_proj"), false)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            rope,
            params: AttentionParams {
                n_heads: cfg.n_heads,
                n_kv_heads: cfg.n_kv_heads,
                head_dim: cfg.head_dim,
                scale: cfg.attn_scale,
                window,
            },
            eps: cfg.rms_eps,
            norm_offset: cfg.norm_offset,
        })
    }

    fn head_norm(&self, be: &CpuBackend, x: Tensor, w: &Option<Vec<f32>>, heads: usize) -> Result<Tensor> {
        let Some(w) = w else { return Ok(x) };
        let (t, width) = x.dims2();
        let dh = self.params.head_dim;
        let y = be.rms_norm(&x.reshape(&[t * heads, dh])?, w, self.eps, self.norm_offset)?;
        Ok(y.reshape(&[t, width])?)
    }

    /// `x (T, D)` at positions `pos0..pos0+T` -> `(T, D)`.
    pub fn forward(&self, be: &CpuBackend, x: &Tensor, cache: &mut LayerKv, pos0: usize, limit: usize) -> Result<Tensor> {
        let p = &self.params;
        let q = self.q.forward(be, x)?;
        let k = self.k.forward(be, x)?;
        let v = self.v.forward(be, x)?;
        let mut q = self.head_norm(be, q, &self.q_norm, p.n_heads)?;
        let mut k = self.head_norm(be, k, &self.k_norm, p.n_kv_heads)?;
        be.rope(&mut q, p.n_heads, pos0, &self.rope)?;
        be.rope(&mut k, p.n_kv_heads, pos0, &self.rope)?;
        cache.write(&k, &v, pos0, limit)?;
        let a = be.attention(&q, &cache.view(), pos0, p)?;
        self.o.forward(be, &a)
    }
}
