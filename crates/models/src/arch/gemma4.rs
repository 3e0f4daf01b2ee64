//! Gemma 4 block, dense and mixture of experts: sandwich norms around attention and the
//! feed-forward half (plain `x · w` RMSNorm), q/k RMSNorm and a scale-less RMSNorm of the values,
//! attention scaling 1, sliding layers and global layers of their own head width and KV heads
//! (the global ones may take their values from the keys' projection and rotate only a fraction
//! of each head: transformers' proportional RoPE), a GELU-tanh MLP, and where the config enables
//! it a routed branch beside the MLP (the MLP then acts as the shared expert); the per-layer
//! embeddings of the E2B/E4B models (a gated input per layer, from the tokens and their
//! embeddings) and their KV-shared layers (queries over an earlier layer's cache); and the
//! layer's scalar on the residual stream.
//! Reference: transformers 5.17's `modeling_gemma4.py` (`Gemma4TextDecoderLayer`,
//! `Gemma4TextAttention`, `Gemma4TextRouter`, `Gemma4TextExperts`); llama.cpp's `gemma4` graph.
//!
//! Not here: training (a clear error).

use hf2q_tensor::moe::{Experts, MoeSpec};
use hf2q_tensor::op::{AttentionParams, Backend, MatmulSpec, RopeParams};
use hf2q_tensor::{QTensor, Tensor, WeightData};

use super::{Block, BlockInputs, Saved};
use crate::config::ModelConfig;
use crate::kv_cache::SeqRef;
use crate::layers::attention::Attention;
use crate::layers::linear::Linear;
use crate::layers::lora::{LoraGrads, TrainCtx};
use crate::layers::mlp::{gate_act, Mlp};
use crate::layers::served::Fwd;
use crate::source::WeightSource;
use crate::{Error, Result};

/// The routed branch of a Gemma 4 MoE layer.
struct RoutedBranch {
    /// (E, D): the router's projection.
    router: QTensor,
    /// (D): the router's learned scale times `D^-½` (its input is `rms_norm(x) · this`).
    router_in: Vec<f32>,
    /// (E): multipliers of the chosen experts' weights.
    per_expert_scale: Vec<f32>,
    experts: Experts,
    top_k: usize,
    /// (D) each: the experts' input norm, and the output norms of the MLP and of the experts.
    pre_norm_2: Vec<f32>,
    post_norm_1: Vec<f32>,
    post_norm_2: Vec<f32>,
}

/// The model-wide tables of the per-layer embeddings, shared by every layer's [`PerLayer`].
#[derive(Clone)]
struct PerLayerTables {
    /// (V·L, P): `embed_tokens_per_layer (V, L·P)` viewed so that row `v·L + i` is token v's
    /// piece for layer i (the same bytes).
    table: QTensor,
    /// (L·P, D): `per_layer_model_projection`.
    proj: QTensor,
    /// (P): `per_layer_projection_norm`.
    proj_norm: Vec<f32>,
}

impl PerLayerTables {
    fn load(src: &WeightSource, cfg: &ModelConfig, p: usize) -> Result<PerLayerTables> {
        let l = cfg.n_layers;
        let t = src.matrix("model.embed_tokens_per_layer.weight")?;
        let proj = src.matrix("model.per_layer_model_projection.weight")?;
        if t.cols != l * p || proj.rows != l * p || proj.cols != cfg.hidden_size {
            return Err(Error::Config(format!(
                "per-layer embeddings '{}' ({} x {}) and '{}' ({} x {}) do not match {l} layers \
                 of width {p} over hidden size {}",
                t.name, t.rows, t.cols, proj.name, proj.rows, proj.cols, cfg.hidden_size
            )));
        }
        let WeightData::Ggml { ty, data } = &t.data else {
            return Err(Error::Config(format!(
                "per-layer embeddings '{}': only float or ggml-quantized tables are read",
                t.name
            )));
        };
        let table = QTensor::ggml(
            &format!("{}#layers", t.name),
            *ty,
            t.rows * l,
            p,
            data.clone(),
        )?;
        let proj_norm = src.vector("model.per_layer_projection_norm.weight")?;
        if proj_norm.len() != p {
            return Err(Error::Config(format!(
                "per_layer_projection_norm has {} values, {p} expected",
                proj_norm.len()
            )));
        }
        Ok(PerLayerTables {
            table,
            proj,
            proj_norm,
        })
    }
}

/// One layer's per-layer embedding (transformers' `get_per_layer_inputs`,
/// `project_per_layer_inputs` and the decoder layer's gate): plain weights, not adapters' sites.
struct PerLayer {
    tables: PerLayerTables,
    /// (P, D): this layer's rows of the model projection.
    proj: QTensor,
    n_layers: usize,
    layer: usize,
    width: usize,
    /// (P, D): `per_layer_input_gate`.
    gate: QTensor,
    /// (D, P): `per_layer_projection`.
    up: QTensor,
    /// (D): `post_per_layer_input_norm`.
    post_norm: Vec<f32>,
}

impl PerLayer {
    /// This layer's input `(ΣT, P)`: `(rms_norm(embed · projᵀ · D^-½) + table[ids] · √P) · 2^-½`.
    fn input(&self, be: &dyn Backend, inp: &BlockInputs<'_>, eps: f32, off: f32) -> Result<Tensor> {
        let vocab = self.tables.table.rows / self.n_layers;
        let ids = inp
            .ids
            .iter()
            .map(|&t| {
                let t = t as usize;
                if t >= vocab {
                    return Err(Error::Msg(format!(
                        "token id {t} is outside the per-layer embeddings of {vocab} tokens"
                    )));
                }
                u32::try_from(t * self.n_layers + self.layer)
                    .map_err(|_| Error::Msg("per-layer embedding row out of range".into()))
            })
            .collect::<Result<Vec<u32>>>()?;
        let pe = be.embedding(&self.tables.table, &ids, (self.width as f64).sqrt() as f32)?;
        let mut pr = be.linear(inp.embed, &self.proj, None)?;
        let d = inp.embed.dims2().1;
        scale_in_place(be, &mut pr, (d as f64).powf(-0.5) as f32)?;
        let mut pr = be.rms_norm(&pr, &self.tables.proj_norm, eps, off)?;
        be.add_assign(&mut pr, &pe)?;
        scale_in_place(be, &mut pr, 0.5f64.sqrt() as f32)?;
        Ok(pr)
    }
}

pub struct Gemma4Block {
    /// (D) each.
    input_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    pre_ffn_norm: Vec<f32>,
    post_ffn_norm: Vec<f32>,
    attn: Attention,
    mlp: Mlp,
    routed: Option<RoutedBranch>,
    per_layer: Option<PerLayer>,
    /// The earlier layer whose cache this one attends over (a KV-shared layer).
    kv_source: Option<usize>,
    /// Multiplies the residual stream at the end of the layer.
    layer_scalar: f32,
    eps: f32,
    offset: f32,
}

/// Every layer's block.
pub fn load_blocks(src: &WeightSource, cfg: &ModelConfig) -> Result<Vec<Box<dyn Block>>> {
    // Proportional RoPE as GGUF carries it: one divisor per frequency of a global head.
    let ff = if src.contains("rope_freqs.weight") {
        Some(src.vector("rope_freqs.weight")?)
    } else if src.format() == crate::source::Format::Gguf && cfg.sliding_layers.contains(&false) {
        // As llama.cpp requires it: without it the global layers' RoPE is unknown.
        return Err(Error::Config(
            "Gemma 4 GGUF has no rope_freqs.weight (the proportional RoPE of its global layers)"
                .into(),
        ));
    } else {
        None
    };
    let width = cfg.gemma4.as_ref().map_or(0, |g| g.per_layer_width);
    let tables = if width > 0 {
        Some(PerLayerTables::load(src, cfg, width)?)
    } else {
        None
    };
    (0..cfg.n_layers)
        .map(|i| -> Result<Box<dyn Block>> {
            Ok(Box::new(Gemma4Block::load(
                src,
                cfg,
                i,
                ff.as_deref(),
                tables.as_ref(),
            )?))
        })
        .collect()
}

/// RoPE of layer `i` of head width `dh`: sliding layers rotate the whole head at their own base;
/// global layers the first `⌊f·dh/2⌋` frequencies (`f` the partial rotary factor; the other
/// frequencies are zero, their dimensions pass unrotated), or as `rope_freqs` divides them.
fn rope_of(cfg: &ModelConfig, i: usize, dh: usize, ff: Option<&[f32]>) -> Result<RopeParams> {
    if cfg.sliding_layers[i] {
        return Ok(RopeParams {
            style: cfg.rope_style,
            theta: cfg.rope_theta_local.unwrap_or(10000.0),
            dims: dh,
            freq_factors: None,
            linear_scale: 1.0,
        });
    }
    let factors = match ff {
        Some(f) if f.len() != dh / 2 => {
            return Err(Error::Config(format!(
                "rope_freqs has {} values, {} expected for global layers of head width {dh}",
                f.len(),
                dh / 2
            )))
        }
        Some(f) => f.to_vec(),
        None => {
            let partial = cfg.gemma4.as_ref().map_or(1.0, |g| g.global_partial_rotary);
            let angles = ((partial as f64 * dh as f64) / 2.0).floor() as usize;
            (0..dh / 2)
                .map(|j| if j < angles { 1.0 } else { f32::INFINITY })
                .collect()
        }
    };
    Ok(RopeParams {
        style: cfg.rope_style,
        theta: cfg.rope_theta,
        dims: dh,
        freq_factors: Some(factors).filter(|f| f.iter().any(|&x| x != 1.0)),
        linear_scale: cfg.rope_linear_factor,
    })
}

fn check_rows(l: &Linear, rows: usize, what: &str) -> Result<()> {
    if l.w.rows != rows {
        return Err(Error::Config(format!(
            "'{}' has {} rows, {rows} expected ({what})",
            l.w.name, l.w.rows
        )));
    }
    Ok(())
}

impl Gemma4Block {
    fn load(
        src: &WeightSource,
        cfg: &ModelConfig,
        i: usize,
        ff: Option<&[f32]>,
        tables: Option<&PerLayerTables>,
    ) -> Result<Gemma4Block> {
        let p = format!("model.layers.{i}");
        let v = |n: &str| src.vector(&format!("{p}.{n}.weight"));
        let (hkv, dh) = cfg.heads_of(i);
        let global = !cfg.sliding_layers[i];
        let k_eq_v = cfg.gemma4.as_ref().is_some_and(|g| g.k_eq_v);
        let bias = cfg.attention_bias;
        let lin = |n: &str| Linear::load(src, &format!("{p}.self_attn.{n}"), bias);
        let kv_source = cfg
            .gemma4
            .as_ref()
            .and_then(|g| g.kv_source.get(i).copied().flatten());
        if kv_source.is_some_and(|s| s >= i || cfg.heads_of(s) != (hkv, dh)) {
            return Err(Error::Config(format!(
                "layer {i} cannot share the keys and values of layer {kv_source:?}"
            )));
        }
        let shared = kv_source.is_some();
        // Keys as values where the config says so on a global layer, or the file has no v.
        let v_name = format!("{p}.self_attn.v_proj.weight");
        let v_is_k = !shared && ((global && k_eq_v) || !src.contains(&v_name));
        let q = lin("q_proj")?;
        check_rows(&q, cfg.n_heads * dh, "heads x head width")?;
        // Products that never run hold their places as views of another weight: the values'
        // where the keys give them, keys' and values' of a KV-shared layer.
        let (k, vp) = if shared {
            (lin("q_proj")?, lin("q_proj")?)
        } else {
            let k = lin("k_proj")?;
            let vp = if v_is_k {
                lin("k_proj")?
            } else {
                lin("v_proj")?
            };
            check_rows(&k, hkv * dh, "kv heads x head width")?;
            check_rows(&vp, hkv * dh, "kv heads x head width")?;
            (k, vp)
        };
        let norm = |n: &str| -> Result<Vec<f32>> {
            let w = v(&format!("self_attn.{n}"))?;
            if w.len() != dh {
                return Err(Error::Config(format!(
                    "{p}.self_attn.{n} has {} values, head width {dh} expected",
                    w.len()
                )));
            }
            Ok(w)
        };
        let attn = Attention {
            q,
            k,
            v: vp,
            o: Linear::load(src, &format!("{p}.self_attn.o_proj"), bias)?,
            q_norm: Some(norm("q_norm")?),
            k_norm: if shared { None } else { Some(norm("k_norm")?) },
            v_norm: (!shared).then(|| vec![1.0 - cfg.norm_offset; dh]),
            v_is_k,
            kv_shared: shared,
            rope: rope_of(cfg, i, dh, ff)?,
            params: AttentionParams {
                n_heads: cfg.n_heads,
                n_kv_heads: hkv,
                head_dim: dh,
                scale: cfg.attn_scale,
                window: if global { None } else { cfg.sliding_window },
                sinks: None,
            },
            eps: cfg.rms_eps,
            norm_offset: cfg.norm_offset,
            norm_full: false,
            q_rot_scale: None,
        };
        let routed = match cfg.moe.as_ref().filter(|m| m.layers[i]) {
            None => None,
            Some(m) => {
                let router = src.matrix(&format!("{p}.router.proj.weight"))?;
                if router.rows != m.n_experts || router.cols != cfg.hidden_size {
                    return Err(Error::Config(format!(
                        "router '{}' is {} x {}, {} experts x {} expected",
                        router.name, router.rows, router.cols, m.n_experts, cfg.hidden_size
                    )));
                }
                let vec_of = |n: &str, len: usize| -> Result<Vec<f32>> {
                    let w = src.vector(&format!("{p}.{n}"))?;
                    if w.len() != len {
                        return Err(Error::Config(format!(
                            "{p}.{n} has {} values, {len} expected",
                            w.len()
                        )));
                    }
                    Ok(w)
                };
                let root = (cfg.hidden_size as f64).powf(-0.5) as f32;
                Some(RoutedBranch {
                    router,
                    router_in: vec_of("router.scale", cfg.hidden_size)?
                        .into_iter()
                        .map(|s| s * root)
                        .collect(),
                    per_expert_scale: vec_of("router.per_expert_scale", m.n_experts)?,
                    experts: src.gemma4_experts(&p, m.n_experts)?,
                    top_k: m.n_used,
                    pre_norm_2: v("pre_feedforward_layernorm_2")?,
                    post_norm_1: v("post_feedforward_layernorm_1")?,
                    post_norm_2: v("post_feedforward_layernorm_2")?,
                })
            }
        };
        let scalar_name = format!("{p}.layer_scalar");
        let layer_scalar = if src.contains(&scalar_name) {
            match src.vector(&scalar_name)?[..] {
                [s] => s,
                ref o => {
                    return Err(Error::Config(format!(
                        "{scalar_name} has {} values, 1 expected",
                        o.len()
                    )))
                }
            }
        } else {
            1.0
        };
        let per_layer = match tables {
            None => None,
            Some(t) => {
                let width = t.proj_norm.len();
                let m = |n: &str, rows: usize, cols: usize| -> Result<QTensor> {
                    let w = src.matrix(&format!("{p}.{n}.weight"))?;
                    if (w.rows, w.cols) != (rows, cols) {
                        return Err(Error::Config(format!(
                            "'{}' is {} x {}, {rows} x {cols} expected",
                            w.name, w.rows, w.cols
                        )));
                    }
                    Ok(w)
                };
                let d = cfg.hidden_size;
                Some(PerLayer {
                    proj: t.proj.row_range(
                        i * width,
                        width,
                        &format!("{}.layer{i}", t.proj.name),
                    )?,
                    tables: t.clone(),
                    n_layers: cfg.n_layers,
                    layer: i,
                    width,
                    gate: m("per_layer_input_gate", width, d)?,
                    up: m("per_layer_projection", d, width)?,
                    post_norm: v("post_per_layer_input_norm")?,
                })
            }
        };
        Ok(Gemma4Block {
            input_norm: v("input_layernorm")?,
            post_attn_norm: v("post_attention_layernorm")?,
            pre_ffn_norm: v("pre_feedforward_layernorm")?,
            post_ffn_norm: v("post_feedforward_layernorm")?,
            attn,
            mlp: Mlp::load(src, &p, cfg.activation)?,
            routed,
            per_layer,
            kv_source,
            layer_scalar,
            eps: cfg.rms_eps,
            offset: cfg.norm_offset,
        })
    }
}

/// `x *= s` on any backend: in place on the host; elsewhere as the product of `x (N, 1)` by
/// `[[1]]` scaled by `s` (one multiply per value, as exact as the host's).
fn scale_in_place(be: &dyn Backend, x: &mut Tensor, s: f32) -> Result<()> {
    if x.is_host() {
        x.data_mut().iter_mut().for_each(|v| *v *= s);
        return Ok(());
    }
    let shape = x.shape().to_vec();
    let n = x.len();
    let one = be.upload(&Tensor::new(&[1, 1], vec![1.0])?)?;
    let y = be.matmul(&x.clone().reshape(&[n, 1])?, &one, MatmulSpec::NN.scaled(s))?;
    *x = y.reshape(&shape)?;
    Ok(())
}

impl Block for Gemma4Block {
    fn rope(&self) -> Option<&RopeParams> {
        Some(&self.attn.rope)
    }
    fn forward(&self, cx: &Fwd, x: &mut Tensor, seqs: &mut [SeqRef<'_>]) -> Result<()> {
        self.forward_with(cx, x, seqs, None)
    }

    fn wants_inputs(&self) -> bool {
        self.per_layer.is_some()
    }

    fn kv_source(&self) -> Option<usize> {
        self.kv_source
    }

    fn forward_with(
        &self,
        cx: &Fwd,
        x: &mut Tensor,
        seqs: &mut [SeqRef<'_>],
        inputs: Option<&BlockInputs<'_>>,
    ) -> Result<()> {
        let (be, eps, off) = (cx.be, self.eps, self.offset);
        let h = be.rms_norm(x, &self.input_norm, eps, off)?;
        let a = self.attn.forward(cx, &h, seqs)?;
        let a = be.rms_norm(&a, &self.post_attn_norm, eps, off)?;
        be.add_assign(x, &a)?;
        let h = be.rms_norm(x, &self.pre_ffn_norm, eps, off)?;
        let mut m = self.mlp.forward(cx, &h)?;
        if let Some(r) = &self.routed {
            // The MLP as shared expert beside the routed experts, both reading the residual.
            m = be.rms_norm(&m, &r.post_norm_1, eps, off)?;
            let logits = be.linear(&be.rms_norm(x, &r.router_in, eps, 0.0)?, &r.router, None)?;
            let spec = MoeSpec {
                top_k: r.top_k,
                renormalize: true,
                expert_scale: Some(&r.per_expert_scale),
                act: gate_act(self.mlp.act),
            };
            let h2 = be.rms_norm(x, &r.pre_norm_2, eps, off)?;
            let e = be.moe_ffn(&h2, &logits, &r.experts, &spec)?;
            be.add_assign(&mut m, &be.rms_norm(&e, &r.post_norm_2, eps, off)?)?;
        }
        be.add_assign(x, &be.rms_norm(&m, &self.post_ffn_norm, eps, off)?)?;
        if let Some(pl) = &self.per_layer {
            let inp = inputs.ok_or_else(|| {
                Error::Msg("Gemma 4's per-layer embeddings need the batch's tokens".into())
            })?;
            let pli = pl.input(be, inp, eps, off)?;
            let g = be.gelu_tanh_mul(&be.linear(x, &pl.gate, None)?, &pli)?;
            let h = be.linear(&g, &pl.up, None)?;
            be.add_assign(x, &be.rms_norm(&h, &pl.post_norm, eps, off)?)?;
        }
        if self.layer_scalar != 1.0 {
            scale_in_place(be, x, self.layer_scalar)?;
        }
        Ok(())
    }

    fn forward_train(&self, _cx: &TrainCtx, _x: &Tensor) -> Result<(Tensor, Saved)> {
        Err(Error::Msg(
            "training Gemma 4 is not supported yet (inference only)".into(),
        ))
    }

    fn backward(
        &self,
        _cx: &TrainCtx,
        _x: &Tensor,
        _saved: Saved,
        _dy: Tensor,
        _grads: &mut LoraGrads,
    ) -> Result<Tensor> {
        Err(Error::Msg(
            "training Gemma 4 is not supported yet (inference only)".into(),
        ))
    }

    /// The attention's products (no `v_proj` where the keys give the values) and the MLP's;
    /// adapters do not reach the router or the experts.
    fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let (a, m) = (&self.attn, &self.mlp);
        let mut l = vec![("self_attn.q_proj", &a.q), ("self_attn.k_proj", &a.k)];
        if !a.v_is_k {
            l.push(("self_attn.v_proj", &a.v));
        }
        l.extend([
            ("self_attn.o_proj", &a.o),
            ("mlp.gate_proj", &m.gate),
            ("mlp.up_proj", &m.up),
            ("mlp.down_proj", &m.down),
        ]);
        l
    }
    fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let (a, m) = (&mut self.attn, &mut self.mlp);
        let mut l = vec![
            ("self_attn.q_proj", &mut a.q),
            ("self_attn.k_proj", &mut a.k),
        ];
        if !a.v_is_k {
            l.push(("self_attn.v_proj", &mut a.v));
        }
        l.extend([
            ("self_attn.o_proj", &mut a.o),
            ("mlp.gate_proj", &mut m.gate),
            ("mlp.up_proj", &mut m.up),
            ("mlp.down_proj", &mut m.down),
        ]);
        l
    }
}
