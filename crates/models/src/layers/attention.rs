//! Self-attention with grouped KV heads, optional q/k bias (Qwen2) and q/k RMSNorm (Qwen3,
//! Gemma 3), RoPE, optional sliding window, writing into the layer's KV cache; and its training
//! forward (a packed batch, no cache) and backward. Gemma 4 adds a scale-less RMSNorm of the
//! values and layers whose keys' projection gives the values (inference only); GPT-OSS a bias
//! on the output projection and per-head sinks in the softmax (inference only).

use hf2q_tensor::op::{AttentionParams, Backend, PreNorm, RopeParams};
use hf2q_tensor::train_op::{AttentionOut, TrainAttention};
use hf2q_tensor::Tensor;

use crate::config::ModelConfig;
use crate::kv_cache::{LayerKv, SeqRef};
use crate::layers::linear::{Linear, LinearSaved};
use crate::layers::lora::{LoraGrads, TrainCtx};
use crate::layers::served::Fwd;
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
    /// (Dh) of `1 - norm_offset`: RMSNorm of the values without a learned scale (Gemma 4).
    pub v_norm: Option<Vec<f32>>,
    /// The values are the keys' projection (Gemma 4's global layers): `v` is not used.
    pub v_is_k: bool,
    /// Attends over another layer's keys and values (the cache it is given holds them):
    /// computes and writes none (Gemma 4's KV-shared layers); `k` and `v` are not used.
    pub kv_shared: bool,
    pub rope: RopeParams,
    pub params: AttentionParams,
    pub eps: f32,
    pub norm_offset: f32,
    /// q/k norms over the whole projection `(H·Dh)`, not per head (OLMo 2).
    pub norm_full: bool,
    /// `(r, f)`: the first `r` dimensions of each query head are multiplied by `f` before RoPE
    /// (LongRoPE's attention factor `s` on a partially rotated head: transformers multiplies
    /// cos and sin by `s`, so the rotated part of q·k by `s²`, carried here as `f = s²` on the
    /// queries alone; a fully rotated head takes `s²` in the attention scale instead).
    pub q_rot_scale: Option<(usize, f32)>,
}

/// Multiplies the first `rot` of every `dh` columns of `x (T, W)` by `s` (through the host for a
/// device tensor).
pub(crate) fn scale_head_cols(
    be: &dyn Backend,
    x: Tensor,
    dh: usize,
    rot: usize,
    s: f32,
) -> Result<Tensor> {
    let host = x.is_host();
    let mut h = if host { x } else { be.to_host(&x)? };
    for head in h.data_mut().chunks_mut(dh) {
        for v in &mut head[..rot] {
            *v *= s;
        }
    }
    Ok(if host { h } else { be.upload(&h)? })
}

/// `x *= s` (through the host for a device tensor).
pub(crate) fn scale_tensor(be: &dyn Backend, x: &mut Tensor, s: f32) -> Result<()> {
    if x.is_host() {
        x.data_mut().iter_mut().for_each(|v| *v *= s);
        return Ok(());
    }
    let mut h = be.to_host(x)?;
    h.data_mut().iter_mut().for_each(|v| *v *= s);
    *x = be.upload(&h)?;
    Ok(())
}

/// A paged store among per-sequence caches: a batch is one or the other.
fn paged_mixed() -> crate::Error {
    crate::Error::Msg("a paged KV store must be the batch's only sequence reference".into())
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
        let fused = format!("{prefix}.self_attn.qkv_proj");
        let (q, k, v) = if src.contains(&format!("{fused}.weight")) {
            // Phi-3: one product of q, k and v rows, split on load.
            let (qw, kvw) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
            let mut parts = Linear::load_split(src, &fused, bias, &[qw, kvw, kvw])?.into_iter();
            let mut next = || parts.next().expect("three parts");
            (next(), next(), next())
        } else {
            (
                Linear::load(src, &format!("{prefix}.self_attn.q_proj"), bias)?,
                Linear::load(src, &format!("{prefix}.self_attn.k_proj"), bias)?,
                Linear::load(src, &format!("{prefix}.self_attn.v_proj"), bias)?,
            )
        };
        // LongRoPE's and YaRN's attention factor (cos and sin times s): on a fully rotated head
        // it is the score's scale (s²); on a partial one, the rotated dimensions of the queries
        // carry s².
        let s = match (&cfg.longrope, &cfg.yarn) {
            (Some(l), _) => l.attn_factor,
            (None, Some(y)) => y.attn_factor,
            (None, None) => 1.0,
        };
        let rotated = rope.dims;
        let (scale, q_rot_scale) = if s == 1.0 || rotated == 0 {
            (cfg.attn_scale, None)
        } else if rotated == cfg.head_dim {
            (cfg.attn_scale * s * s, None)
        } else {
            (cfg.attn_scale, Some((rotated, s * s)))
        };
        let sinks = if cfg.attention_sinks {
            let s = src.vector(&format!("{prefix}.self_attn.sinks"))?;
            if s.len() != cfg.n_heads {
                return Err(crate::Error::Config(format!(
                    "'{prefix}.self_attn.sinks' has {} values for {} heads",
                    s.len(),
                    cfg.n_heads
                )));
            }
            Some(s)
        } else {
            None
        };
        Ok(Attention {
            q,
            k,
            v,
            // The output projection's bias where the checkpoint has one (GPT-OSS; Qwen2's
            // attention bias stops at q/k/v).
            o: Linear::load(
                src,
                &format!("{prefix}.self_attn.o_proj"),
                bias && src.contains(&format!("{prefix}.self_attn.o_proj.bias")),
            )?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            v_norm: None,
            v_is_k: false,
            kv_shared: false,
            rope,
            params: AttentionParams {
                n_heads: cfg.n_heads,
                n_kv_heads: cfg.n_kv_heads,
                head_dim: cfg.head_dim,
                scale,
                window,
                sinks: sinks.map(Into::into),
            },
            eps: cfg.rms_eps,
            norm_offset: cfg.norm_offset,
            norm_full: cfg.qk_norm_full,
            q_rot_scale,
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
        if self.norm_full {
            return Ok(be.rms_norm(&x, w, self.eps, self.norm_offset)?);
        }
        let dh = self.params.head_dim;
        let y = be.rms_norm(&x.reshape(&[t * heads, dh])?, w, self.eps, self.norm_offset)?;
        Ok(y.reshape(&[t, width])?)
    }

    /// `x (ΣT, D)`: the rows of every sequence in `seqs` -> `(ΣT, D)`. Projections run once over
    /// the whole batch; norms, RoPE, cache writes and attention run per sequence.
    pub fn forward(&self, cx: &Fwd, x: &Tensor, seqs: &mut [SeqRef<'_>]) -> Result<Tensor> {
        let a = self.heads(cx, x, None, seqs)?;
        self.o.forward(cx, &a)
    }

    /// `x += forward(rms_norm(x), seqs)`: a pre-norm block's attention half (the backend may
    /// fold the norm into the q/k/v product).
    pub fn forward_residual(
        &self,
        cx: &Fwd,
        norm: PreNorm<'_>,
        seqs: &mut [SeqRef<'_>],
        x: &mut Tensor,
    ) -> Result<()> {
        let a = self.heads(cx, x, Some(norm), seqs)?;
        self.o.forward_add(cx, &a, x)
    }

    /// Everything before the output projection: `(ΣT, D) -> (ΣT, H*Dh)`.
    /// With `norm`, of `rms_norm(x)`.
    fn heads(
        &self,
        cx: &Fwd,
        x: &Tensor,
        norm: Option<PreNorm<'_>>,
        seqs: &mut [SeqRef<'_>],
    ) -> Result<Tensor> {
        let (be, p) = (cx.be, &self.params);
        if self.kv_shared {
            return self.heads_shared(cx, x, norm, seqs);
        }
        let lins: &[&Linear] = if self.v_is_k {
            &[&self.q, &self.k]
        } else {
            &[&self.q, &self.k, &self.v]
        };
        let ws: Vec<(&hf2q_tensor::QTensor, Option<&[f32]>)> =
            lins.iter().map(|l| (&l.w, l.b.as_deref())).collect();
        let attached = lins.iter().any(|l| l.lora.is_some());
        let served = cx
            .lora
            .is_some_and(|b| lins.iter().any(|l| b.touches(l.site)));
        let mut qkv = match norm {
            // An attached adapter: each product with its term.
            _ if attached => {
                let h = match norm {
                    Some(n) => be.rms_norm(x, n.w, n.eps, n.offset)?,
                    None => x.clone(),
                };
                lins.iter()
                    .map(|l| l.forward(cx, &h))
                    .collect::<Result<Vec<_>>>()?
            }
            // Served adapters: the base products together over every row, then each
            // adapter's terms on its rows (they read the normed rows too).
            _ if served => {
                let normed;
                let h = match norm {
                    Some(n) => {
                        normed = be.rms_norm(x, n.w, n.eps, n.offset)?;
                        &normed
                    }
                    None => x,
                };
                let mut ys = be.linear_many(h, &ws)?;
                for (l, y) in lins.iter().zip(ys.iter_mut()) {
                    l.add_served(cx, h, y)?;
                }
                ys
            }
            Some(n) => be.norm_linear_many(x, n, &ws)?,
            None => be.linear_many(x, &ws)?,
        }
        .into_iter();
        let (Some(q), Some(k)) = (qkv.next(), qkv.next()) else {
            return Err(crate::Error::Msg(
                "linear_many returned fewer outputs than products".into(),
            ));
        };
        let v = if self.v_is_k {
            None
        } else {
            Some(qkv.next().ok_or_else(|| {
                crate::Error::Msg("linear_many returned fewer than 3 outputs".into())
            })?)
        };
        let qw = q.dims2().1;
        if let [SeqRef {
            kv: LayerKv::Paged { store, step },
            ..
        }] = seqs
        {
            // Every row of the step at once: norms, RoPE and the cache writes over all rows, one
            // attention over the shared paged store.
            let mut qs = self.head_norm(be, q, &self.q_norm, p.n_heads)?;
            if let Some((r, s)) = self.q_rot_scale {
                qs = scale_head_cols(be, qs, p.head_dim, r, s)?;
            }
            // The values before the keys' norm and RoPE (a copy of their own when the keys'
            // projection gives them).
            let vs = match v {
                Some(v) => v,
                None => be.rows(&k, 0, k.dims2().0)?,
            };
            let vs = self.head_norm(be, vs, &self.v_norm, p.n_kv_heads)?;
            let mut ks = self.head_norm(be, k, &self.k_norm, p.n_kv_heads)?;
            be.paged_rope_store(&mut qs, &mut ks, &vs, p.n_heads, store, step, &self.rope)?;
            let a = be.paged_attend(&qs, store, step, p)?;
            return Ok(a.reshape(&[x.dims2().0, qw])?);
        }
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
            if let Some((r, s)) = self.q_rot_scale {
                qs = scale_head_cols(be, qs, p.head_dim, r, s)?;
            }
            let mut ks = self.head_norm(be, rows(&k)?, &self.k_norm, p.n_kv_heads)?;
            let vs = match &v {
                Some(v) => rows(v)?,
                // The keys before their norm and RoPE, as a tensor of their own (a device
                // tensor's clone would share the keys' buffer).
                None => be.rows(&k, s.start, s.len)?,
            };
            let vs = self.head_norm(be, vs, &self.v_norm, p.n_kv_heads)?;
            let LayerKv::Seq(kv) = &mut s.kv else {
                return Err(paged_mixed());
            };
            be.rope_store(
                &mut qs,
                &mut ks,
                &vs,
                p.n_heads,
                p.n_kv_heads,
                kv,
                s.pos0,
                s.limit,
                &self.rope,
            )?;
            parts.push(be.attend(&qs, kv, s.pos0, p)?);
        }
        let a = if whole {
            parts.pop().expect("one sequence")
        } else {
            be.concat_rows(&parts)?
        };
        Ok(a.reshape(&[x.dims2().0, qw])?)
    }
}

impl Attention {
    /// [`Attention::heads`] of a KV-shared layer: the queries alone, normed and rotated, over
    /// the keys and values already in the cache of each sequence.
    fn heads_shared(
        &self,
        cx: &Fwd,
        x: &Tensor,
        norm: Option<PreNorm<'_>>,
        seqs: &mut [SeqRef<'_>],
    ) -> Result<Tensor> {
        let (be, p) = (cx.be, &self.params);
        let q = match norm {
            Some(n) => self.q.forward(cx, &be.rms_norm(x, n.w, n.eps, n.offset)?)?,
            None => self.q.forward(cx, x)?,
        };
        let mut parts = Vec::with_capacity(seqs.len());
        for s in seqs.iter() {
            let LayerKv::Seq(kv) = &s.kv else {
                return Err(crate::Error::Msg(
                    "a layer attending over another layer's keys (Gemma 4's KV-shared layers) \
                     has no paged KV cache path yet"
                        .into(),
                ));
            };
            let mut qs =
                self.head_norm(be, be.rows(&q, s.start, s.len)?, &self.q_norm, p.n_heads)?;
            if let Some((r, f)) = self.q_rot_scale {
                qs = scale_head_cols(be, qs, p.head_dim, r, f)?;
            }
            be.rope(&mut qs, p.n_heads, s.pos0, &self.rope)?;
            parts.push(be.attend(&qs, kv, s.pos0, p)?);
        }
        let a = be.concat_rows(&parts)?;
        Ok(a.reshape(&[x.dims2().0, q.dims2().1])?)
    }
}

/// What [`Attention::forward_train`] keeps for the backward.
pub struct AttentionSaved {
    /// (N, H*Dh), (N, Hkv*Dh): q and k before their head norms (when the family has them).
    q_pre: Option<Tensor>,
    k_pre: Option<Tensor>,
    /// (N, H*Dh), (N, Hkv*Dh), (N, Hkv*Dh): what attention read (q, k normed and rotated).
    q: Tensor,
    k: Tensor,
    v: Tensor,
    att: AttentionOut,
    lin: [LinearSaved; 4],
}

impl Attention {
    fn train_params(&self) -> TrainAttention {
        TrainAttention {
            p: self.params.clone(),
            softcap: None,
        }
    }

    /// The training forward of `h (N, D)` (the block's normed input) -> `(N, D)`, over the
    /// sequences of `cx.layout` (positions restart with each sequence; no cache).
    pub fn forward_train(&self, cx: &TrainCtx, h: &Tensor) -> Result<(Tensor, AttentionSaved)> {
        let (be, p) = (cx.be, &self.params);
        if self.v_is_k || self.v_norm.is_some() || self.kv_shared {
            return Err(crate::Error::Msg(
                "training attention whose values are normed or are the keys (Gemma 4) is not \
                 supported yet"
                    .into(),
            ));
        }
        if p.sinks.is_some() {
            return Err(crate::Error::Msg(
                "training attention with sinks (GPT-OSS) is not supported yet".into(),
            ));
        }
        let (q, sq) = self.q.forward_train(cx, h)?;
        let (k, sk) = self.k.forward_train(cx, h)?;
        let (v, sv) = self.v.forward_train(cx, h)?;
        let (q_pre, k_pre) = (
            self.q_norm.as_ref().map(|_| q.clone()),
            self.k_norm.as_ref().map(|_| k.clone()),
        );
        let mut q = self.head_norm(be, q, &self.q_norm, p.n_heads)?;
        if let Some((r, s)) = self.q_rot_scale {
            q = scale_head_cols(be, q, p.head_dim, r, s)?;
        }
        let mut k = self.head_norm(be, k, &self.k_norm, p.n_kv_heads)?;
        be.rope_rows(&mut q, p.n_heads, cx.layout, &self.rope, false)?;
        be.rope_rows(&mut k, p.n_kv_heads, cx.layout, &self.rope, false)?;
        let att = be.attention_train(&q, &k, &v, cx.layout, &self.train_params())?;
        let (o, so) = self.o.forward_train(cx, &att.out)?;
        Ok((
            o,
            AttentionSaved {
                q_pre,
                k_pre,
                q,
                k,
                v,
                att,
                lin: [sq, sk, sv, so],
            },
        ))
    }

    /// From `dy (N, D)`, the gradient of [`Attention::forward_train`]'s input `h (N, D)`.
    pub fn backward(
        &self,
        cx: &TrainCtx,
        h: &Tensor,
        s: &AttentionSaved,
        dy: &Tensor,
        grads: &mut LoraGrads,
    ) -> Result<Tensor> {
        let (be, p) = (cx.be, &self.params);
        let [sq, sk, sv, so] = &s.lin;
        let dout = self.o.backward(cx, &s.att.out, so, dy, grads)?;
        let g = be.attention_backward(
            &s.q,
            &s.k,
            &s.v,
            &s.att,
            &dout,
            cx.layout,
            &self.train_params(),
        )?;
        let (mut dq, mut dk) = (g.dq, g.dk);
        be.rope_rows(&mut dq, p.n_heads, cx.layout, &self.rope, true)?;
        be.rope_rows(&mut dk, p.n_kv_heads, cx.layout, &self.rope, true)?;
        if let Some((r, s)) = self.q_rot_scale {
            dq = scale_head_cols(be, dq, p.head_dim, r, s)?;
        }
        let dq = self.head_norm_backward(cx, s.q_pre.as_ref(), &self.q_norm, dq, p.n_heads)?;
        let dk = self.head_norm_backward(cx, s.k_pre.as_ref(), &self.k_norm, dk, p.n_kv_heads)?;
        let mut dh = self.q.backward(cx, h, sq, &dq, grads)?;
        be.add_assign(&mut dh, &self.k.backward(cx, h, sk, &dk, grads)?)?;
        be.add_assign(&mut dh, &self.v.backward(cx, h, sv, &g.dv, grads)?)?;
        Ok(dh)
    }

    /// The backward of [`Attention::head_norm`] (identity where the family has no head norm).
    fn head_norm_backward(
        &self,
        cx: &TrainCtx,
        pre: Option<&Tensor>,
        w: &Option<Vec<f32>>,
        dy: Tensor,
        heads: usize,
    ) -> Result<Tensor> {
        let (Some(w), Some(pre)) = (w, pre) else {
            return Ok(dy);
        };
        let (t, width) = dy.dims2();
        if self.norm_full {
            return Ok(cx
                .be
                .rms_norm_backward(pre, w, self.eps, self.norm_offset, &dy)?);
        }
        let dh = self.params.head_dim;
        let x = pre.clone().reshape(&[t * heads, dh])?;
        let g = cx.be.rms_norm_backward(
            &x,
            w,
            self.eps,
            self.norm_offset,
            &dy.reshape(&[t * heads, dh])?,
        )?;
        Ok(g.reshape(&[t, width])?)
    }
}
