//! Self-attention with grouped KV heads, optional q/k bias (Qwen2) and q/k RMSNorm (Qwen3,
//! Gemma 3), RoPE, optional sliding window, writing into the layer's KV cache.

use hf2q_tensor::op::{AttentionParams, Backend, PreNorm, RopeParams};
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
        be: &dyn Backend,
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
    pub fn forward(&self, be: &dyn Backend, x: &Tensor, seqs: &mut [SeqRef<'_>]) -> Result<Tensor> {
        let a = self.heads(be, x, None, seqs)?;
        self.o.forward(be, &a)
    }

    /// `x += forward(rms_norm(x), seqs)`: a pre-norm block's attention half (the backend may
    /// fold the norm into the q/k/v product).
    pub fn forward_residual(
        &self,
        be: &dyn Backend,
        norm: PreNorm<'_>,
        seqs: &mut [SeqRef<'_>],
        x: &mut Tensor,
    ) -> Result<()> {
        let a = self.heads(be, x, Some(norm), seqs)?;
        self.o.forward_add(be, &a, x)
    }

    /// Everything before the output projection: `(ΣT, D) -> (ΣT, H*Dh)`.
    /// With `norm`, of `rms_norm(x)`.
    fn heads(
        &self,
        be: &dyn Backend,
        x: &Tensor,
        norm: Option<PreNorm<'_>>,
        seqs: &mut [SeqRef<'_>],
    ) -> Result<Tensor> {
        let p = &self.params;
        let ws = [
            (&self.q.w, self.q.b.as_deref()),
            (&self.k.w, self.k.b.as_deref()),
            (&self.v.w, self.v.b.as_deref()),
        ];
        let mut qkv = match norm {
            Some(n) => be.norm_linear_many(x, n, &ws)?,
            None => be.linear_many(x, &ws)?,
        }
        .into_iter();
        let (Some(q), Some(k), Some(v)) = (qkv.next(), qkv.next(), qkv.next()) else {
            return Err(crate::Error::Msg(
                "linear_many returned fewer than 3 outputs".into(),
            ));
        };
        let qw = q.dims2().1;
        // One sequence covering the batch (decode of one stream, any prefill): no row copies.
        let whole = seqs.len() == 1 && seqs[0].start == 0 && seqs[0].len == x.dims2().0;
        let mut parts = Vec::with_capacity(seqs.len());
        for s in seqs.iter_mut() {
            let rows = |t: &Tensor| -> Result<Tensor> {
                if whole {
                    Ok(t.clone())
                } else {
                    Ok(be.rows(t, s.start, s.len)?)
                }
            };
            let mut qs = self.head_norm(be, rows(&q)?, &self.q_norm, p.n_heads)?;
            let mut ks = self.head_norm(be, rows(&k)?, &self.k_norm, p.n_kv_heads)?;
            let vs = rows(&v)?;
            be.rope_store(
                &mut qs,
                &mut ks,
                &vs,
                p.n_heads,
                p.n_kv_heads,
                s.kv,
                s.pos0,
                s.limit,
                &self.rope,
            )?;
            parts.push(be.attend(&qs, s.kv, s.pos0, p)?);
        }
        let a = if whole {
            parts.pop().expect("one sequence")
        } else {
            be.concat_rows(&parts)?
        };
        Ok(a.reshape(&[x.dims2().0, qw])?)
    }
}
