//! One config for every architecture, filled from a Hugging Face `config.json` or from GGUF
//! metadata (`<arch>.*` keys). Architecture code reads only this struct.

use hf2q_tensor::io::gguf::GgufFile;
use hf2q_tensor::op::RopeStyle;
use serde_json::Value;

use crate::{Error, Result};

mod gemma4;
pub mod gpt_oss;
pub mod minicpm;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM, Mistral / Ministral.
    Llama,
    /// Llama + q/k/v bias.
    Qwen2,
    /// Llama + q/k RMSNorm.
    Qwen3,
    /// Qwen3 with routed experts in place of the MLP (all layers or some).
    Qwen3Moe,
    Gemma3,
    /// Gemma 4 (dense, and the mixture of experts): sliding and global layers of their own head
    /// width and KV heads, keys as values on global layers, a routed branch beside the MLP.
    Gemma4,
    /// Phi-3 / Phi-4: fused q/k/v and gate/up products (split on load), partial rotary,
    /// LongRoPE.
    Phi3,
    /// SmolLM3: no RoPE on the layers its config names.
    SmolLm3,
    /// Granite: embedding, residual, attention and logit multipliers.
    Granite,
    /// OLMo 2: norms after attention and MLP (no pre-norms), q/k norms over the whole projection.
    Olmo2,
    /// MiniCPM: a Llama with embedding, residual and logit multipliers (`config/minicpm.rs`).
    MiniCpm,
    /// GPT-OSS: attention sinks and biases, sliding and full layers, YaRN, routed experts with
    /// biases and the clamped SwiGLU, MXFP4 experts (`config/gpt_oss.rs`).
    GptOss,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Gemma3 => "gemma3",
            Arch::Gemma4 => "gemma4",
            Arch::Phi3 => "phi3",
            Arch::SmolLm3 => "smollm3",
            Arch::Granite => "granite",
            Arch::Olmo2 => "olmo2",
            Arch::MiniCpm => "minicpm",
            Arch::GptOss => "gpt-oss",
        }
    }
    /// The Hugging Face `model_type`s the loader accepts, for messages.
    pub const SUPPORTED_HF: &'static [&'static str] = &[
        "llama",
        "mistral",
        "ministral",
        "smollm",
        "smollm2",
        "mixtral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma3",
        "gemma3_text",
        "gemma4",
        "gemma4_text",
        "phi3",
        "smollm3",
        "granite",
        "olmo2",
        "minicpm",
        "gpt_oss",
    ];
    /// The GGUF `general.architecture`s the loader accepts, for messages.
    pub const SUPPORTED_GGUF: &'static [&'static str] = &[
        "llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma3", "gemma4", "phi3", "smollm3",
        "granite", "olmo2", "minicpm", "gpt-oss",
    ];
    fn from_hf(model_type: &str) -> Option<Arch> {
        Some(match model_type {
            // Mixtral is a Llama whose MLPs are experts, as llama.cpp has it.
            "llama" | "mistral" | "ministral" | "smollm" | "smollm2" | "mixtral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3_moe" => Arch::Qwen3Moe,
            "gemma3" | "gemma3_text" => Arch::Gemma3,
            "gemma4" | "gemma4_text" => Arch::Gemma4,
            "phi3" => Arch::Phi3,
            "smollm3" => Arch::SmolLm3,
            "granite" => Arch::Granite,
            "olmo2" => Arch::Olmo2,
            "minicpm" => Arch::MiniCpm,
            "gpt_oss" => Arch::GptOss,
            _ => return None,
        })
    }
    /// llama.cpp's converter permutes this family's q/k rows (Llama's interleaved RoPE in GGUF).
    pub fn permutes_qk(self) -> bool {
        matches!(
            self,
            Arch::Llama | Arch::Granite | Arch::SmolLm3 | Arch::MiniCpm
        )
    }
    pub fn from_gguf(arch: &str) -> Option<Arch> {
        Some(match arch {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            "gemma3" => Arch::Gemma3,
            "gemma4" => Arch::Gemma4,
            "phi3" => Arch::Phi3,
            "smollm3" => Arch::SmolLm3,
            "granite" => Arch::Granite,
            "olmo2" => Arch::Olmo2,
            "minicpm" => Arch::MiniCpm,
            "gpt-oss" => Arch::GptOss,
            _ => return None,
        })
    }
}

/// Routed experts in place of the MLP ([`hf2q_tensor::moe`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// E
    pub n_experts: usize,
    /// k: experts per token.
    pub n_used: usize,
    /// F_e: the width of one expert.
    pub expert_width: usize,
    /// Renormalise the chosen experts' probabilities to sum to 1.
    pub renormalize: bool,
    /// Per layer: true where the MLP is routed (Qwen3-MoE's `mlp_only_layers` and
    /// `decoder_sparse_step` make some layers dense).
    pub layers: Vec<bool>,
    /// GPT-OSS: the experts' activation is the clamped SwiGLU at this limit (alpha
    /// [`gpt_oss::SWIGLU_ALPHA`]), and the router and the experts' products carry biases.
    pub clamped_swiglu: Option<f32>,
}

impl MoeConfig {
    fn validate(&self, n_layers: usize) -> Result<()> {
        if self.n_experts == 0 || self.n_experts > 4096 {
            return Err(bad(format!("{} experts is out of range", self.n_experts)));
        }
        if self.n_used == 0 || self.n_used > self.n_experts {
            return Err(bad(format!(
                "{} experts per token of {}",
                self.n_used, self.n_experts
            )));
        }
        if self.expert_width == 0 || self.expert_width > (1 << 24) {
            return Err(bad(format!(
                "expert width {} is out of range",
                self.expert_width
            )));
        }
        if self.layers.len() != n_layers {
            return Err(bad("the routed-layer pattern does not cover every layer"));
        }
        Ok(())
    }
    /// Parameters of one token's pass through a routed MLP that are used (k experts) and stored
    /// (E experts), for `bench` and `inspect`: `3 · D · F_e` per expert.
    pub fn expert_params(&self, hidden: usize) -> usize {
        3 * hidden * self.expert_width
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
}

/// Llama 3 frequency-dependent RoPE scaling (`rope_type: llama3`).
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position: usize,
}

/// LongRoPE (Phi-3 / Phi-4, `rope_type: longrope`): per-frequency divisors for sequences up
/// to `original_max_position` (`short`) and beyond (`long`), `rope_dims / 2` each, and the
/// factor transformers multiplies cos and sin by.
#[derive(Clone, Debug, PartialEq)]
pub struct LongRope {
    pub short_factor: Vec<f32>,
    pub long_factor: Vec<f32>,
    pub original_max_position: usize,
    pub attn_factor: f32,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    /// V
    pub vocab_size: usize,
    /// D
    pub hidden_size: usize,
    /// F
    pub intermediate_size: usize,
    pub n_layers: usize,
    /// H
    pub n_heads: usize,
    /// Hkv (Gemma 4: of its sliding layers; `layer_heads` has every layer's).
    pub n_kv_heads: usize,
    /// Dh (Gemma 4: of its sliding layers; `layer_heads` has every layer's).
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Base θ of sliding-window (local) layers, when it differs (Gemma 3: 10 000).
    pub rope_theta_local: Option<f32>,
    pub rope_style: RopeStyle,
    pub llama3_scaling: Option<Llama3Scaling>,
    /// LongRoPE scaling (Phi-3 / Phi-4).
    pub longrope: Option<LongRope>,
    /// YaRN scaling (GPT-OSS).
    pub yarn: Option<gpt_oss::Yarn>,
    /// Dimensions of each head RoPE rotates (the first ones; `partial_rotary_factor · Dh`).
    pub rope_dims: usize,
    /// Per layer: true where the layer applies no RoPE (SmolLM3's `no_rope_layers[i] == 0`).
    pub nope_layers: Vec<bool>,
    /// Linear RoPE scaling factor of global layers (1.0 = none).
    pub rope_linear_factor: f32,
    pub context_length: usize,
    /// Sliding window of local layers.
    pub sliding_window: Option<usize>,
    /// Per layer: true when the layer uses the sliding window.
    pub sliding_layers: Vec<bool>,
    pub tie_embeddings: bool,
    pub attention_bias: bool,
    /// A learned per-head logit in every layer's softmax (`self_attn.sinks`, GPT-OSS).
    pub attention_sinks: bool,
    pub qk_norm: bool,
    pub activation: Activation,
    /// Multiplier applied to embeddings (Gemma: √D).
    pub embed_scale: f32,
    /// Added to RMSNorm weights at run time: 1.0 for Gemma checkpoints in HF layout ((1+w) norm);
    /// 0.0 for GGUF, whose converter already added the 1.
    pub norm_offset: f32,
    /// Gemma 3's extra norms around attention and MLP outputs.
    pub sandwich_norms: bool,
    /// Attention score multiplier (1/√Dh, or Gemma's query_pre_attn_scalar^-½).
    pub attn_scale: f32,
    pub final_logit_softcap: Option<f32>,
    /// Routed experts, for the families that have them.
    pub moe: Option<MoeConfig>,
    /// Multiplier of each block half's output before it joins the residual (Granite's
    /// `residual_multiplier`; 1.0 = none).
    pub residual_scale: f32,
    /// Multiplier of the logits (1 / Granite's `logits_scaling`; 1.0 = none).
    pub logit_scale: f32,
    /// q/k RMSNorm over the whole projection `(H·Dh)` rather than per head (OLMo 2).
    pub qk_norm_full: bool,
    /// Per layer: `(Hkv, Dh)` of its attention (Gemma 4's global layers differ from its
    /// sliding ones; every other family repeats `(n_kv_heads, head_dim)`).
    pub layer_heads: Vec<(usize, usize)>,
    /// What only Gemma 4 has.
    pub gemma4: Option<Gemma4Config>,
}

/// Gemma 4's own settings (the rest of the family lives in [`ModelConfig`]'s common fields:
/// per-layer heads in `layer_heads`, the routed branch in `moe`).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma4Config {
    /// Global layers have no value projection: the keys' projection gives the values.
    pub k_eq_v: bool,
    /// The fraction of a global layer's head that RoPE rotates (transformers' proportional
    /// RoPE: the first `⌊f·Dh/2⌋` frequencies of `θ^(-2i/Dh)`, the others zero).
    pub global_partial_rotary: f32,
    /// Per layer: the earlier layer whose keys and values it attends over (KV-shared layers,
    /// the last `num_kv_shared_layers`: the last unshared layer of the same kind), or `None`.
    pub kv_source: Vec<Option<usize>>,
    /// Width of the per-layer embeddings (`hidden_size_per_layer_input`, the E2B/E4B models);
    /// 0: none.
    pub per_layer_width: usize,
}

impl ModelConfig {
    /// Keys and values a KV cache holds per position, over every layer (each layer's own
    /// `Hkv · Dh`, twice: Gemma 4's global layers are wider than its sliding ones).
    pub fn kv_values_per_token(&self) -> usize {
        (0..self.n_layers)
            .map(|i| {
                let (kv, dh) = self.heads_of(i);
                2 * kv * dh
            })
            .sum()
    }

    /// `(Hkv, Dh)` of layer `i`'s attention.
    pub fn heads_of(&self, i: usize) -> (usize, usize) {
        self.layer_heads
            .get(i)
            .copied()
            .unwrap_or((self.n_kv_heads, self.head_dim))
    }
}

fn bad(msg: impl Into<String>) -> Error {
    Error::Config(msg.into())
}

/// Checks cross-field invariants once, so architecture code can index without fear.
fn validate(c: &ModelConfig) -> Result<()> {
    let nz = [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("num_hidden_layers", c.n_layers),
        ("num_attention_heads", c.n_heads),
        ("num_key_value_heads", c.n_kv_heads),
        ("head_dim", c.head_dim),
    ];
    for (k, v) in nz {
        if v == 0 || v > (1 << 24) {
            return Err(bad(format!("{k} = {v} is out of range")));
        }
    }
    if !c.n_heads.is_multiple_of(c.n_kv_heads) {
        return Err(bad(format!(
            "{} heads is not a multiple of {} kv heads",
            c.n_heads, c.n_kv_heads
        )));
    }
    if !c.head_dim.is_multiple_of(2) {
        return Err(bad(format!("head_dim {} is odd", c.head_dim)));
    }
    if c.rope_dims > c.head_dim || !c.rope_dims.is_multiple_of(2) {
        return Err(bad(format!(
            "{} rotated dims for head width {}",
            c.rope_dims, c.head_dim
        )));
    }
    if c.nope_layers.len() != c.n_layers {
        return Err(bad("the no-RoPE layer pattern does not cover every layer"));
    }
    if let Some(l) = &c.longrope {
        for (k, f) in [
            ("short_factor", &l.short_factor),
            ("long_factor", &l.long_factor),
        ] {
            if f.len() != c.rope_dims / 2 {
                return Err(bad(format!(
                    "longrope {k} has {} values, {} expected",
                    f.len(),
                    c.rope_dims / 2
                )));
            }
        }
    }
    if !(c.residual_scale.is_finite() && c.logit_scale.is_finite() && c.logit_scale != 0.0) {
        return Err(bad("residual or logit multiplier out of range"));
    }
    if c.sliding_layers.len() != c.n_layers {
        return Err(bad("sliding layer pattern does not cover every layer"));
    }
    if c.layer_heads.len() != c.n_layers {
        return Err(bad("per-layer attention heads do not cover every layer"));
    }
    for (i, &(kv, dh)) in c.layer_heads.iter().enumerate() {
        if kv == 0 || kv > (1 << 16) || dh == 0 || dh > (1 << 16) || !dh.is_multiple_of(2) {
            return Err(bad(format!(
                "layer {i}: {kv} kv heads of width {dh} is out of range"
            )));
        }
        if !c.n_heads.is_multiple_of(kv) {
            return Err(bad(format!(
                "layer {i}: {} heads is not a multiple of {kv} kv heads",
                c.n_heads
            )));
        }
    }
    if let Some(m) = &c.moe {
        m.validate(c.n_layers)?;
    }
    if !(c.rms_eps > 0.0 && c.rms_eps < 1.0) || !(c.rope_theta > 0.0) {
        return Err(bad(format!(
            "rms_eps {} / rope_theta {} out of range",
            c.rms_eps, c.rope_theta
        )));
    }
    Ok(())
}

/// The experts of a Hugging Face config: Qwen3-MoE (`num_experts`, written `num_local_experts`
/// by transformers 5, `moe_intermediate_size`, `norm_topk_prob`, dense layers by
/// `mlp_only_layers` and `decoder_sparse_step`) and Mixtral (`num_local_experts`, the expert
/// width in `intermediate_size`, always renormalised).
fn moe_from_hf(v: &Value, model_type: &str, n_layers: usize) -> Result<Option<MoeConfig>> {
    let u = |k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as usize);
    let need = |k: &str| u(k).ok_or_else(|| bad(format!("config.json lacks '{k}'")));
    let experts = || {
        u("num_experts")
            .or_else(|| u("num_local_experts"))
            .ok_or_else(|| bad("config.json lacks 'num_experts'"))
    };
    Ok(match model_type {
        "mixtral" => Some(MoeConfig {
            n_experts: experts()?,
            n_used: need("num_experts_per_tok")?,
            expert_width: need("intermediate_size")?,
            renormalize: true,
            layers: vec![true; n_layers],
            clamped_swiglu: None,
        }),
        "qwen3_moe" => {
            let dense: Vec<usize> = v
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_u64)
                        .map(|x| x as usize)
                        .collect()
                })
                .unwrap_or_default();
            let step = u("decoder_sparse_step").unwrap_or(1);
            let n_experts = experts()?;
            Some(MoeConfig {
                n_experts,
                n_used: need("num_experts_per_tok")?,
                expert_width: need("moe_intermediate_size")?,
                renormalize: v.get("norm_topk_prob").and_then(Value::as_bool) == Some(true),
                layers: (0..n_layers)
                    .map(|i| !dense.contains(&i) && step > 0 && (i + 1).is_multiple_of(step))
                    .collect(),
                clamped_swiglu: None,
            })
        }
        "gpt_oss" => Some(gpt_oss::moe_from_hf(v, n_layers)?),
        _ => None,
    })
}

/// LongRoPE from a Phi-3 config (as transformers' `_compute_longrope_parameters`): the factors
/// in `r` (`rope_parameters`, or the older `rope_scaling`), `original_max_position_embeddings`
/// there or at the top, and the attention factor given, or
/// `sqrt(1 + ln s / ln original)` with `s = factor`, else `max_position / original` (1 when
/// `s <= 1`).
fn longrope_from_hf(v: &Value, r: &Value, rope_dims: usize) -> Result<LongRope> {
    let factors = |k: &str| -> Result<Vec<f32>> {
        let a = r
            .get(k)
            .and_then(Value::as_array)
            .ok_or_else(|| bad(format!("longrope scaling lacks {k}")))?;
        let f: Vec<f32> = a
            .iter()
            .filter_map(Value::as_f64)
            .map(|x| x as f32)
            .collect();
        if f.len() != a.len() || f.len() != rope_dims / 2 || f.iter().any(|x| !(*x > 0.0)) {
            return Err(bad(format!(
                "longrope {k} must be {} positive numbers",
                rope_dims / 2
            )));
        }
        Ok(f)
    };
    let num = |k: &str| {
        r.get(k)
            .and_then(Value::as_f64)
            .or_else(|| v.get(k).and_then(Value::as_f64))
    };
    let original = num("original_max_position_embeddings")
        .ok_or_else(|| bad("longrope scaling lacks original_max_position_embeddings"))?;
    if !(original > 1.0) {
        return Err(bad(
            "longrope original_max_position_embeddings out of range",
        ));
    }
    let factor = r
        .get("factor")
        .and_then(Value::as_f64)
        .or_else(|| {
            v.get("max_position_embeddings")
                .and_then(Value::as_f64)
                .map(|m| m / original)
        })
        .unwrap_or(1.0);
    let attn_factor = match r.get("attention_factor").and_then(Value::as_f64) {
        Some(a) => a,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / original.ln()).sqrt(),
    };
    Ok(LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position: original as usize,
        attn_factor: attn_factor as f32,
    })
}

/// LongRoPE of a Phi-3 GGUF: the `rope_factors_short/long` tensors, the original context
/// (`rope.scaling.original_context_length`) and `rope.scaling.attn_factor`; `None` without
/// the tensors.
fn longrope_from_gguf(g: &GgufFile, a: &str) -> Result<Option<LongRope>> {
    let factors = |n: &str| -> Result<Option<Vec<f32>>> {
        let Some(info) = g.tensor(n) else {
            return Ok(None);
        };
        let len = match info.dims.as_slice() {
            [n] => *n as usize,
            _ => return Err(bad(format!("tensor '{n}' is not 1-D"))),
        };
        let mut out = vec![0f32; len];
        hf2q_tensor::quant::dequantize(info.ty, g.tensor_data(info)?.as_slice(), &mut out)?;
        Ok(Some(out))
    };
    let (Some(short_factor), Some(long_factor)) = (
        factors("rope_factors_short.weight")?,
        factors("rope_factors_long.weight")?,
    ) else {
        return Ok(None);
    };
    Ok(Some(LongRope {
        short_factor,
        long_factor,
        original_max_position: g
            .get_u64(&format!("{a}.rope.scaling.original_context_length"))
            .unwrap_or(4096) as usize,
        attn_factor: g
            .get_f32(&format!("{a}.rope.scaling.attn_factor"))
            .unwrap_or(1.0),
    }))
}

fn gemma_sliding(n_layers: usize, pattern: usize) -> Vec<bool> {
    // Every `pattern`-th layer is global; the others use the sliding window.
    (0..n_layers)
        .map(|i| pattern == 0 || (i + 1) % pattern != 0)
        .collect()
}

impl ModelConfig {
    /// From a Hugging Face `config.json` (also MLX folders, which keep the same file).
    pub fn from_hf_json(v: &Value) -> Result<ModelConfig> {
        // Multimodal Gemma 3 checkpoints nest the language model's config.
        let v = v.get("text_config").filter(|t| t.is_object()).unwrap_or(v);
        let mt = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("config.json has no model_type"))?;
        let arch = Arch::from_hf(mt).ok_or_else(|| {
            let named = v
                .get("architectures")
                .and_then(Value::as_array)
                .and_then(|a| a.first())
                .and_then(Value::as_str)
                .map(|a| format!(" ({a})"))
                .unwrap_or_default();
            bad(format!(
                "unsupported model_type '{mt}'{named}; supported: {}",
                Arch::SUPPORTED_HF.join(", ")
            ))
        })?;
        if arch == Arch::MiniCpm {
            minicpm::check_hf(v)?;
        }
        if arch == Arch::GptOss {
            gpt_oss::check_hf(v)?;
        }
        let u = |k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as usize);
        let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
        let req = |k: &str| u(k).ok_or_else(|| bad(format!("config.json lacks '{k}'")));
        let hidden = req("hidden_size")?;
        let n_heads = req("num_attention_heads")?;
        let n_layers = req("num_hidden_layers")?;
        let head_dim = u("head_dim").unwrap_or(if n_heads > 0 { hidden / n_heads } else { 0 });
        let gemma = matches!(arch, Arch::Gemma3 | Arch::Gemma4);
        // RoPE settings: transformers >= 5 writes `rope_parameters` (flat, or keyed by layer
        // type for Gemma 3); older files have top-level `rope_theta` + `rope_scaling`.
        let rp = v.get("rope_parameters").filter(|r| r.is_object());
        let (rp_global, rp_local) = match rp.and_then(|r| r.get("full_attention")) {
            Some(full) => (Some(full), rp.and_then(|r| r.get("sliding_attention"))),
            None => (rp, None),
        };
        let theta_of = |r: Option<&Value>| {
            r.and_then(|r| r.get("rope_theta"))
                .and_then(Value::as_f64)
                .map(|x| x as f32)
        };
        let rope_theta = theta_of(rp_global)
            .or_else(|| f("rope_theta"))
            .unwrap_or(10000.0);
        let rope_theta_local = theta_of(rp_local)
            .or_else(|| f("rope_local_base_freq"))
            .unwrap_or(10000.0);
        let rs = rp_global
            .or_else(|| v.get("rope_scaling"))
            .filter(|r| r.is_object());
        let rope_type = rs
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str);
        let llama3_scaling = match (rope_type, rs) {
            (Some("llama3"), Some(r)) => {
                let g = |k: &str| r.get(k).and_then(Value::as_f64);
                Some(Llama3Scaling {
                    factor: g("factor").ok_or_else(|| bad("llama3 rope scaling lacks factor"))?
                        as f32,
                    low_freq_factor: g("low_freq_factor").unwrap_or(1.0) as f32,
                    high_freq_factor: g("high_freq_factor").unwrap_or(4.0) as f32,
                    original_max_position: g("original_max_position_embeddings").unwrap_or(8192.0)
                        as usize,
                })
            }
            // Gemma 4's global layers ("proportional") are read by `gemma4::from_hf`; LongRoPE
            // below.
            (Some(t), _)
                if !matches!(t, "default" | "llama3" | "linear")
                    && arch != Arch::Gemma4
                    && !(arch == Arch::Phi3 && matches!(t, "longrope" | "su"))
                    && !(arch == Arch::GptOss && t == "yarn") =>
            {
                return Err(bad(format!("unsupported RoPE type '{t}'")));
            }
            _ => None,
        };
        let rope_linear_factor = match (rope_type, rs) {
            (Some("linear"), Some(r)) => {
                r.get("factor").and_then(Value::as_f64).unwrap_or(1.0) as f32
            }
            _ => 1.0,
        };
        // Mistral (v0.1) applies its window whenever one is set; Qwen2 only with use_sliding_window.
        let sliding_window = if gemma
            || matches!(mt, "mistral" | "ministral" | "gpt_oss")
            || v.get("use_sliding_window").and_then(Value::as_bool) == Some(true)
        {
            u("sliding_window")
        } else {
            None
        };
        let sliding_layers = if let Some(lt) = v.get("layer_types").and_then(Value::as_array) {
            lt.iter()
                .map(|t| t.as_str() == Some("sliding_attention"))
                .collect()
        } else if gemma {
            gemma_sliding(n_layers, u("sliding_window_pattern").unwrap_or(6))
        } else {
            vec![sliding_window.is_some(); n_layers]
        };
        let attn_scale = if gemma {
            (f("query_pre_attn_scalar").unwrap_or(head_dim as f32)).powf(-0.5)
        } else {
            (head_dim as f32).powf(-0.5)
        };
        // Partial rotary (Phi-4-mini): in rope_parameters (transformers >= 5) or at the top.
        let partial = rs
            .and_then(|r| r.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .or_else(|| v.get("partial_rotary_factor").and_then(Value::as_f64))
            .unwrap_or(1.0);
        let rope_dims = ((head_dim as f64 * partial) as usize) & !1;
        let longrope = match (rope_type, rs) {
            (Some("longrope" | "su"), Some(r)) if arch == Arch::Phi3 => {
                Some(longrope_from_hf(v, r, rope_dims)?)
            }
            _ => None,
        };
        // SmolLM3: `no_rope_layers[i] == 0` marks a layer without RoPE; absent, every
        // `no_rope_layer_interval`-th (default 4) as transformers fills it.
        let nope_layers = if arch == Arch::SmolLm3 {
            match v.get("no_rope_layers").and_then(Value::as_array) {
                Some(a) => {
                    if a.len() != n_layers {
                        return Err(bad(format!(
                            "no_rope_layers has {} entries for {n_layers} layers",
                            a.len()
                        )));
                    }
                    a.iter().map(|x| x.as_u64() == Some(0)).collect()
                }
                None => {
                    let every = u("no_rope_layer_interval").unwrap_or(4).max(1);
                    (0..n_layers).map(|i| (i + 1) % every == 0).collect()
                }
            }
        } else {
            vec![false; n_layers]
        };
        let granite = arch == Arch::Granite;
        let attn_scale = match f("attention_multiplier") {
            Some(m) if granite => m,
            _ => attn_scale,
        };
        let moe = moe_from_hf(v, mt, n_layers)?;
        let yarn = match (rope_type, rs) {
            (Some("yarn"), Some(r)) if arch == Arch::GptOss => Some(gpt_oss::Yarn::from_hf(
                r,
                u("max_position_embeddings").unwrap_or(2048),
            )?),
            _ => None,
        };
        let c = ModelConfig {
            arch,
            vocab_size: req("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: req("intermediate_size")?,
            n_layers,
            n_heads,
            n_kv_heads: u("num_key_value_heads").unwrap_or(n_heads),
            head_dim,
            rms_eps: f("rms_norm_eps").unwrap_or(1e-6),
            rope_theta,
            rope_theta_local: if gemma { Some(rope_theta_local) } else { None },
            rope_style: RopeStyle::Neox,
            llama3_scaling,
            longrope,
            yarn,
            rope_dims,
            nope_layers,
            rope_linear_factor,
            context_length: u("max_position_embeddings").unwrap_or(2048),
            sliding_window,
            sliding_layers,
            tie_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(gemma),
            attention_bias: arch == Arch::Qwen2
                || v.get("attention_bias").and_then(Value::as_bool) == Some(true),
            attention_sinks: arch == Arch::GptOss,
            qk_norm: matches!(
                arch,
                Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::Olmo2
            ),
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            embed_scale: if gemma {
                (hidden as f32).sqrt()
            } else if granite {
                f("embedding_multiplier").unwrap_or(1.0)
            } else {
                1.0
            },
            norm_offset: if gemma { 1.0 } else { 0.0 },
            sandwich_norms: gemma,
            attn_scale,
            final_logit_softcap: f("final_logit_softcapping"),
            moe,
            residual_scale: if granite {
                f("residual_multiplier").unwrap_or(1.0)
            } else {
                1.0
            },
            logit_scale: if granite {
                1.0 / f("logits_scaling").unwrap_or(1.0)
            } else {
                1.0
            },
            qk_norm_full: arch == Arch::Olmo2,
            layer_heads: Vec::new(),
            gemma4: None,
        };
        let mut c = c;
        c.layer_heads = vec![(c.n_kv_heads, c.head_dim); n_layers];
        if arch == Arch::MiniCpm {
            minicpm::from_hf(&mut c, v)?;
        }
        if arch == Arch::Gemma4 {
            gemma4::from_hf(&mut c, v)?;
            // Gemma 4 builds each layer's RoPE itself (`head_dim` is now its sliding width).
            c.rope_dims = c.head_dim;
        }
        validate(&c)?;
        Ok(c)
    }

    /// From GGUF metadata. `has_output` says whether an `output.weight` tensor exists (else the
    /// embeddings are tied).
    pub fn from_gguf(g: &GgufFile, has_output: bool) -> Result<ModelConfig> {
        let a = g
            .architecture()
            .ok_or_else(|| bad("GGUF has no general.architecture"))?
            .to_string();
        let arch = Arch::from_gguf(&a).ok_or_else(|| {
            bad(format!(
                "unsupported GGUF architecture '{a}'; supported: {}",
                Arch::SUPPORTED_GGUF.join(", ")
            ))
        })?;
        let key = |k: &str| format!("{a}.{k}");
        let u = |k: &str| g.get_u64(&key(k)).map(|x| x as usize);
        let f = |k: &str| g.get_f32(&key(k));
        let req = |k: &str| u(k).ok_or_else(|| bad(format!("GGUF lacks '{}'", key(k))));
        let hidden = req("embedding_length")?;
        let n_heads = req("attention.head_count")?;
        let n_layers = req("block_count")?;
        let head_dim =
            u("attention.key_length").unwrap_or(if n_heads > 0 { hidden / n_heads } else { 0 });
        let vocab = match u("vocab_size") {
            Some(v) => v,
            None => g
                .get_str_array("tokenizer.ggml.tokens")
                .map(|t| t.len())
                .unwrap_or(0),
        };
        let gemma = matches!(arch, Arch::Gemma3 | Arch::Gemma4);
        let sliding_window = u("attention.sliding_window");
        let sliding_layers = if gemma {
            // Every N-th layer is global; llama.cpp writes N when it differs from Gemma 3's 6.
            gemma_sliding(n_layers, u("attention.sliding_window_pattern").unwrap_or(6))
        } else {
            vec![sliding_window.is_some(); n_layers]
        };
        let scaling_type = g.get_str(&key("rope.scaling.type"));
        let granite = arch == Arch::Granite;
        let rope_linear_factor = if scaling_type == Some("linear") {
            f("rope.scaling.factor").unwrap_or(1.0)
        } else {
            1.0
        };
        let c = ModelConfig {
            arch,
            vocab_size: vocab,
            hidden_size: hidden,
            // A number, or one per layer (Gemma 4): the first layer's.
            intermediate_size: match g.get_array(&key("feed_forward_length")) {
                Some(a) => a.values.first().and_then(|x| x.as_u64()).unwrap_or(0) as usize,
                None => req("feed_forward_length")?,
            },
            n_layers,
            n_heads,
            n_kv_heads: u("attention.head_count_kv").unwrap_or(n_heads),
            head_dim,
            rms_eps: f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
            rope_theta: f("rope.freq_base").unwrap_or(10000.0),
            rope_theta_local: if gemma { Some(10000.0) } else { None },
            // ggml's Llama (and Granite, SmolLM3, MiniCPM, converted as Llama) uses interleaved
            // pairs on permuted q/k rows; Qwen, Gemma, Phi-3 and OLMo 2 use NEOX.
            rope_style: if arch.permutes_qk() {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Neox
            },
            // Llama 3 scaling arrives as the `rope_freqs.weight` tensor in GGUF.
            llama3_scaling: None,
            // LongRoPE factors are tensors in llama.cpp's layout (`rope_factors_short/long`).
            longrope: if arch == Arch::Phi3 {
                longrope_from_gguf(g, &a)?
            } else {
                None
            },
            yarn: None,
            // Partial rotary is Phi's (Gemma 4 writes its global layers' width here).
            rope_dims: if arch == Arch::Phi3 {
                u("rope.dimension_count").unwrap_or(head_dim)
            } else {
                head_dim
            },
            // llama.cpp's SmolLM3: no RoPE on every fourth layer.
            nope_layers: (0..n_layers)
                .map(|i| arch == Arch::SmolLm3 && (i + 1) % 4 == 0)
                .collect(),
            rope_linear_factor,
            context_length: u("context_length").unwrap_or(2048),
            sliding_window,
            sliding_layers,
            tie_embeddings: !has_output,
            attention_bias: arch == Arch::Qwen2,
            attention_sinks: false,
            qk_norm: matches!(
                arch,
                Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3 | Arch::Olmo2
            ),
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            embed_scale: if gemma {
                (hidden as f32).sqrt()
            } else if granite {
                f("embedding_scale").unwrap_or(1.0)
            } else {
                1.0
            },
            norm_offset: 0.0,
            sandwich_norms: gemma,
            attn_scale: match f("attention.scale") {
                Some(s) if granite => s,
                _ => (head_dim as f32).powf(-0.5),
            },
            final_logit_softcap: f("final_logit_softcapping"),
            residual_scale: if granite {
                f("residual_scale").unwrap_or(1.0)
            } else {
                1.0
            },
            logit_scale: if granite {
                1.0 / f("logit_scale").unwrap_or(1.0)
            } else {
                1.0
            },
            qk_norm_full: arch == Arch::Olmo2,
            moe: match u("expert_count").filter(|&e| e > 0) {
                None => None,
                Some(n_experts) => Some(MoeConfig {
                    n_experts,
                    n_used: req("expert_used_count")?,
                    // Mixtral's GGUF (arch `llama`) keeps the expert width in feed_forward_length.
                    expert_width: u("expert_feed_forward_length")
                        .map_or_else(|| req("feed_forward_length"), Ok)?,
                    // llama.cpp renormalises for these families unless the file says otherwise.
                    renormalize: g.get_bool(&key("expert_weights_norm")).unwrap_or(true),
                    // A layer is routed where its router is stored (llama.cpp writes every
                    // layer routed; a file with dense layers keeps ffn_gate/up/down there).
                    layers: (0..n_layers)
                        .map(|i| g.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_some())
                        .collect(),
                    clamped_swiglu: None,
                }),
            },
            layer_heads: Vec::new(),
            gemma4: None,
        };
        let mut c = c;
        c.layer_heads = vec![(c.n_kv_heads, c.head_dim); n_layers];
        if arch == Arch::MiniCpm {
            minicpm::from_gguf(&mut c, g);
        }
        if arch == Arch::GptOss {
            gpt_oss::from_gguf(&mut c, g, &a)?;
        }
        if arch == Arch::Gemma4 {
            gemma4::from_gguf(&mut c, g)?;
            // Gemma 4 builds each layer's RoPE itself (`head_dim` is now its sliding width).
            c.rope_dims = c.head_dim;
        }
        validate(&c)?;
        Ok(c)
    }

    /// Llama 3 per-frequency divisors (as transformers' `_compute_llama3_parameters`).
    pub fn llama3_freq_factors(&self) -> Option<Vec<f32>> {
        let s = self.llama3_scaling.as_ref()?;
        let pi = std::f64::consts::PI;
        let low_wavelen = s.original_max_position as f64 / s.low_freq_factor as f64;
        let high_wavelen = s.original_max_position as f64 / s.high_freq_factor as f64;
        Some(
            (0..self.head_dim / 2)
                .map(|i| {
                    let freq =
                        (self.rope_theta as f64).powf(-(2.0 * i as f64) / self.head_dim as f64);
                    let wavelen = 2.0 * pi / freq;
                    let factor = if wavelen < high_wavelen {
                        1.0
                    } else if wavelen > low_wavelen {
                        s.factor as f64
                    } else {
                        let smooth = (s.original_max_position as f64 / wavelen
                            - s.low_freq_factor as f64)
                            / (s.high_freq_factor as f64 - s.low_freq_factor as f64);
                        // new_freq = (1-smooth)*freq/factor + smooth*freq  => divisor:
                        1.0 / ((1.0 - smooth) / s.factor as f64 + smooth)
                    };
                    factor as f32
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base(extra: Value) -> Value {
        let mut v = serde_json::json!({
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    #[test]
    fn sliding_window_rules_per_family() {
        let m = ModelConfig::from_hf_json(&base(
            serde_json::json!({"model_type": "mistral", "sliding_window": 4096}),
        ))
        .unwrap();
        assert_eq!(m.sliding_window, Some(4096));
        assert_eq!(m.sliding_layers, vec![true, true]);
        let q = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": false}))).unwrap();
        assert_eq!(q.sliding_window, None);
        assert!(q.attention_bias);
        let g = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "gemma3_text", "sliding_window": 512, "num_hidden_layers": 12}))).unwrap();
        assert_eq!(
            g.sliding_layers.iter().filter(|s| !**s).count(),
            2,
            "every 6th layer is global"
        );
        assert!(!g.sliding_layers[5] && !g.sliding_layers[11]);
    }

    #[test]
    fn llama_variants_from_hf_configs() {
        // Phi-3 / Phi-4-mini: partial rotary and LongRoPE, in transformers 5's layout and in
        // the older one (`rope_scaling` of type "longrope", the rest at the top).
        let p = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "phi3",
            "max_position_embeddings": 131072, "rope_parameters": {"rope_type": "longrope",
            "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 4096,
            "short_factor": vec![1.0; 6], "long_factor": vec![2.0; 6]}})))
        .unwrap();
        assert_eq!((p.arch, p.head_dim, p.rope_dims), (Arch::Phi3, 16, 12));
        let l = p.longrope.unwrap();
        assert_eq!(l.original_max_position, 4096);
        let want = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt() as f32;
        assert!((l.attn_factor - want).abs() < 1e-6, "{}", l.attn_factor);
        let p = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "phi3",
            "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "short_factor": vec![1.0; 8],
            "long_factor": vec![2.0; 8]}})))
        .unwrap();
        assert_eq!((p.rope_dims, p.longrope.unwrap().attn_factor), (16, 1.0));
        let e = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "phi3",
            "original_max_position_embeddings": 64, "rope_scaling": {"type": "longrope",
            "short_factor": vec![1.0; 3], "long_factor": vec![2.0; 8]}})))
        .unwrap_err();
        assert!(e.to_string().contains("short_factor must be 8"), "{e}");
        // SmolLM3: no_rope_layers as written, or every fourth layer.
        let s = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "smollm3",
            "num_hidden_layers": 8})))
        .unwrap();
        assert_eq!(
            s.nope_layers,
            vec![false, false, false, true, false, false, false, true]
        );
        let s = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "smollm3",
            "no_rope_layers": [0, 1]})))
        .unwrap();
        assert_eq!(s.nope_layers, vec![true, false]);
        // Granite's multipliers.
        let g = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "granite",
            "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
            "attention_multiplier": 0.0078125, "logits_scaling": 8.0})))
        .unwrap();
        assert_eq!(
            (g.embed_scale, g.residual_scale, g.attn_scale, g.logit_scale),
            (12.0, 0.22, 0.0078125, 0.125)
        );
        // OLMo 2: q/k norms over the whole projection; Ministral's window.
        let o =
            ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "olmo2"}))).unwrap();
        assert!(o.qk_norm && o.qk_norm_full);
        let m = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "ministral",
            "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]})))
        .unwrap();
        assert_eq!((m.arch, m.sliding_window), (Arch::Llama, Some(32)));
        assert_eq!(m.sliding_layers, vec![true, false]);
    }

    #[test]
    fn experts_from_hf_configs() {
        let q = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "qwen3_moe",
            "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "norm_topk_prob": true, "mlp_only_layers": [0],
            "decoder_sparse_step": 2})))
        .unwrap();
        let m = q.moe.unwrap();
        assert_eq!((m.n_experts, m.n_used, m.expert_width), (8, 2, 32));
        assert!(m.renormalize);
        // Layer 0 dense by mlp_only_layers, layer 2 by the sparse step of 2.
        assert_eq!(m.layers, vec![false, true, false, true]);
        let x = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "mixtral",
            "num_local_experts": 4, "num_experts_per_tok": 2})))
        .unwrap();
        assert_eq!(x.arch, Arch::Llama);
        let m = x.moe.unwrap();
        assert_eq!((m.n_experts, m.expert_width, m.renormalize), (4, 128, true));
        let e = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "mixtral",
            "num_local_experts": 4, "num_experts_per_tok": 5})))
        .unwrap_err();
        assert!(e.to_string().contains("5 experts per token of 4"), "{e}");
        let e = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "qwen3_moe",
            "num_experts_per_tok": 2, "moe_intermediate_size": 32})))
        .unwrap_err();
        assert!(e.to_string().contains("num_experts"), "{e}");
    }

    #[test]
    fn bad_configs_are_named() {
        let e = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "gpt_neox"})))
            .unwrap_err();
        assert!(
            e.to_string().contains("unsupported model_type 'gpt_neox'"),
            "{e}"
        );
        // The refusal names the checkpoint's class and lists what is supported.
        let mut j = base(serde_json::json!({"model_type": "deepseek_v3"}));
        j["architectures"] = serde_json::json!(["DeepseekV3ForCausalLM"]);
        let e = ModelConfig::from_hf_json(&j).unwrap_err().to_string();
        assert!(e.contains("'deepseek_v3' (DeepseekV3ForCausalLM)"), "{e}");
        for a in [
            "llama", "phi3", "smollm3", "granite", "olmo2", "gemma4", "gpt_oss",
        ] {
            assert!(e.contains(a), "{e}");
        }
        let e = ModelConfig::from_hf_json(&base(
            serde_json::json!({"model_type": "llama", "num_key_value_heads": 3}),
        ))
        .unwrap_err();
        assert!(e.to_string().contains("not a multiple"), "{e}");
        let e = ModelConfig::from_hf_json(&base(
            serde_json::json!({"model_type": "llama", "hidden_size": 0}),
        ))
        .unwrap_err();
        assert!(e.to_string().contains("hidden_size = 0"), "{e}");
        let e = ModelConfig::from_hf_json(&base(serde_json::json!({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))).unwrap_err();
        assert!(
            e.to_string().contains("unsupported RoPE type 'yarn'"),
            "{e}"
        );
    }
}
