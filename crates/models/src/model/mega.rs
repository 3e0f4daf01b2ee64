//! A model's decode step as the CUDA decode megakernel's description (`--cuda-opt decode=mega`):
//! which models it takes (every block a plain pre-norm Llama layer with a dense SiLU MLP, no
//! biases, adapters, q/k norms, windows or sinks, one RoPE and one attention shape for all
//! layers) and the step itself (embedding, the kernel, then the logits as the per-op step).
//!
//! Not here: the kernel and its checks of formats and caches (`hf2q_cuda::mega`), the graph
//! capture (`Model::decode_graph`).

use hf2q_cuda::backend::CudaBackend;
use hf2q_cuda::mega::{MegaLayerRef, MegaModel};
use hf2q_tensor::op::{AttentionParams, RopeParams};
use hf2q_tensor::Tensor;

use super::Model;
use crate::config::Activation;
use crate::kv_cache::KvCache;
use crate::layers::linear::Linear;
use crate::Result;

fn same_rope(a: &RopeParams, b: &RopeParams) -> bool {
    a.style == b.style
        && a.theta.to_bits() == b.theta.to_bits()
        && a.dims == b.dims
        && a.linear_scale.to_bits() == b.linear_scale.to_bits()
        && a.freq_factors == b.freq_factors
}

fn same_attention(a: &AttentionParams, b: &AttentionParams) -> bool {
    a.n_heads == b.n_heads
        && a.n_kv_heads == b.n_kv_heads
        && a.head_dim == b.head_dim
        && a.scale.to_bits() == b.scale.to_bits()
        && a.window.is_none()
        && b.window.is_none()
        && a.sinks.is_none()
        && b.sinks.is_none()
}

fn plain(l: &Linear) -> bool {
    l.b.is_none() && l.lora.is_none()
}

impl Model {
    /// The megakernel's view of this model over `cache`, or `None` where a block is not a plain
    /// Llama layer (the kernel's own checks of formats and caches come after).
    pub(super) fn mega_model<'a>(&'a self, cache: &'a KvCache) -> Option<MegaModel<'a>> {
        if self.config.norm_offset != 0.0 || cache.layers.len() != self.blocks.len() {
            return None;
        }
        let first = self.blocks.first()?.dense_llama()?;
        let mut layers = Vec::with_capacity(self.blocks.len());
        for (b, kv) in self.blocks.iter().zip(&cache.layers) {
            let d = b.dense_llama()?;
            let (a, m) = (d.attn, d.mlp);
            let ok = a.q_norm.is_none()
                && a.k_norm.is_none()
                && a.v_norm.is_none()
                && !a.v_is_k
                && !a.kv_shared
                && a.q_rot_scale.is_none()
                && [&a.q, &a.k, &a.v, &a.o, &m.gate, &m.up, &m.down]
                    .into_iter()
                    .all(plain)
                && m.act == Activation::Silu
                && d.eps.to_bits() == self.config.rms_eps.to_bits()
                && same_rope(&a.rope, &first.attn.rope)
                && same_attention(&a.params, &first.attn.params);
            if !ok {
                return None;
            }
            layers.push(MegaLayerRef {
                attn_norm: d.attn_norm,
                mlp_norm: d.mlp_norm,
                q: &a.q.w,
                k: &a.k.w,
                v: &a.v.w,
                o: &a.o.w,
                gate: &m.gate.w,
                up: &m.up.w,
                down: &m.down.w,
                kv,
            });
        }
        Some(MegaModel {
            layers,
            final_norm: &self.final_norm,
            eps: self.config.rms_eps,
            offset: 0.0,
            rope: &first.attn.rope,
            attn: &first.attn.params,
        })
    }

    /// Readies the megakernel for decode steps over `cache` (outside a capture); `false` where
    /// it does not run this model (or `decode=mega` is off).
    pub(super) fn mega_prepare(&self, cuda: &CudaBackend, cache: &KvCache) -> Result<bool> {
        if !cuda.mega_enabled() {
            return Ok(false);
        }
        match self.mega_model(cache) {
            Some(m) => Ok(cuda.mega_prepare(&m)?),
            None => Ok(false),
        }
    }

    /// The final-normed hidden state `(1, D)` of `token` at `pos0` through the megakernel, or
    /// `None` where it does not run this step (the per-op step runs instead).
    pub(super) fn mega_hidden(
        &self,
        cuda: &CudaBackend,
        cache: &KvCache,
        pos0: usize,
        token: u32,
    ) -> Result<Option<Tensor>> {
        if !cuda.mega_enabled() {
            return Ok(None);
        }
        let Some(m) = self.mega_model(cache) else {
            return Ok(None);
        };
        let x = self
            .be()
            .embedding(&self.embed, &[token], self.config.embed_scale)?;
        Ok(cuda.mega_step(&x, &m, pos0)?)
    }
}
