//! Self-attention with grouped KV heads, optional q/k bias (Qwen2) and q/k RMSNorm (Qwen3,
//! Gemma 3), RoPE, optional sliding window, writing into the layer's KV cache.

use hf2q_tensor::cpu::CpuBackend;
use hf2q_tensor::op::{AttentionParams, Backend, RopeParams};
use hf2q_tensor::Tensor;

use crate::config::ModelConfig;
use crate::kv_cache::SeqRef;
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
    pub fn load(
        src: &WeightSource,
        cfg: &ModelConfig,
        prefix: &str,
        rope: RopeParams,
        window: Option<usize>,
    ) -> Result<Attention> {
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

    fn head_norm(
        &self,
        be: &CpuBackend,
        x: Tensor,
        w: &Option<Vec<f32>>,
        heads: usize,
    ) -> Result<Tensor> {
        let Some(w) = w else { return Ok(x) };
        let (t, width) = x.dims2();
        let dh = self.params.head_dim;
        let y = be.rms_norm(&x.reshape(&[t * heads, dh])?, w, self.eps, self.norm_offset)?;
        Ok(y.reshape(&[t, width])?)
    }

    /// `x (ΣT, D)`: the rows of every sequence in `seqs` -> `(ΣT, D)`. Projections run once over
    /// the whole batch; norms, RoPE, cache writes and attention run per sequence.
    pub fn forward(&self, be: &CpuBackend, x: &Tensor, seqs: &mut [SeqRef<'_>]) -> Result<Tensor> {
        let p = &self.params;
        let q = self.q.forward(be, x)?;
        let k = self.k.forward(be, x)?;
        let v = self.v.forward(be, x)?;
        let (qw, kw) = (q.dims2().1, k.dims2().1);
        let mut out = vec![0f32; q.len()];
        for s in seqs.iter_mut() {
            let rows = |t: &Tensor, w: usize| {
                Tensor::new(
                    &[s.len, w],
                    t.data()[s.start * w..(s.start + s.len) * w].to_vec(),
                )
            };
            let qs = self.head_norm(be, rows(&q, qw)?, &self.q_norm, p.n_heads)?;
            let ks = self.head_norm(be, rows(&k, kw)?, &self.k_norm, p.n_kv_heads)?;
            let vs = rows(&v, kw)?;
            let (mut qs, mut ks) = (qs, ks);
            be.rope(&mut qs, p.n_heads, s.pos0, &self.rope)?;
            be.rope(&mut ks, p.n_kv_heads, s.pos0, &self.rope)?;
            s.kv.write(&ks, &vs, s.pos0, s.limit)?;
            let a = be.attention(&qs, &s.kv.view(), s.pos0, p)?;
            out[s.start * qw..(s.start + s.len) * qw].copy_from_slice(a.data());
        }
        let a = Tensor::new(&[x.dims2().0, qw], out)?;
        self.o.forward(be, &a)
    }
}
