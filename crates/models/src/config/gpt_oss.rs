//! GPT-OSS's config (`GptOssForCausalLM`, model_type `gpt_oss`) and YaRN RoPE.
//!
//! GPT-OSS is a pre-norm decoder whose attention has q/k/v/o biases and per-head sinks
//! ([`ModelConfig::attention_sinks`]), alternating sliding-window and full layers (`layer_types`,
//! `sliding_window`), YaRN RoPE ([`Yarn`]), and routed experts in every layer: a router with a
//! bias, top-k then a softmax over the chosen k, experts with biases and the clamped SwiGLU
//! ([`MoeConfig::clamped_swiglu`]), stored as MXFP4 (`quantization_config.quant_method =
//! "mxfp4"`). The block itself is the Llama block (`arch/llama.rs`) over these settings.
//! Reference: transformers' `modeling_gpt_oss.py` and `_compute_yarn_parameters` in
//! `modeling_rope_utils.py`.
//!
//! GGUF (llama.cpp's `gpt-oss` architecture) carries the same settings in its own keys
//! ([`from_gguf`]); what it leaves implicit (biases, sinks, the SwiGLU limit 7, even layers
//! sliding, renormalised top-k) is llama.cpp's fixed choice for the family, which is
//! transformers'.
//!
//! Not here: the harmony chat template, other quantization methods of the experts (refused by
//! name).

use hf2q_tensor::io::gguf::GgufFile;
use serde_json::Value;

use super::{bad, ModelConfig, MoeConfig};
use crate::Result;

/// GPT-OSS's SwiGLU `alpha` (fixed in transformers' `GptOssExperts`).
pub const SWIGLU_ALPHA: f32 = 1.702;

/// YaRN RoPE (`rope_type: yarn`), as transformers' `_compute_yarn_parameters`: per frequency a
/// blend of the original inverse frequency and the one divided by `factor`, by a linear ramp
/// between the dimensions where `beta_fast` and `beta_slow` rotations fit the original context;
/// cos and sin multiplied by `attn_factor`.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub original_max_position: f64,
    /// Round the ramp's ends to whole dimensions (transformers' default; GPT-OSS sets false).
    pub truncate: bool,
    /// The multiplier of cos and sin: `attention_factor` as given, else
    /// `0.1 · mscale · ln(factor) + 1` (over the same with `mscale_all_dim` when both are
    /// given), 1 for `factor <= 1`.
    pub attn_factor: f32,
}

fn get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl Yarn {
    /// From a `rope_parameters` (or `rope_scaling`) object `r` of a config whose context is
    /// `max_position`. As transformers 5: the original context is
    /// `original_max_position_embeddings` (else `max_position`), the factor the one written,
    /// else `max_position / original` (DeepSeek-V3's convention).
    pub fn from_hf(r: &Value, max_position: usize) -> Result<Yarn> {
        let num = |k: &str| r.get(k).and_then(Value::as_f64);
        let original = num("original_max_position_embeddings").unwrap_or(max_position as f64);
        let factor = match num("factor") {
            Some(f) => f,
            None if original < max_position as f64 => max_position as f64 / original,
            None => return Err(bad("yarn RoPE scaling lacks factor")),
        };
        if !(original >= 1.0 && factor.is_finite() && factor > 0.0) {
            return Err(bad(format!(
                "yarn RoPE: factor {factor} over original context {original} is out of range"
            )));
        }
        let attn_factor = match num("attention_factor") {
            Some(a) => a,
            None => match (num("mscale"), num("mscale_all_dim")) {
                (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                    get_mscale(factor, m) / get_mscale(factor, a)
                }
                _ => get_mscale(factor, 1.0),
            },
        };
        Ok(Yarn {
            factor,
            beta_fast: num("beta_fast").filter(|&b| b != 0.0).unwrap_or(32.0),
            beta_slow: num("beta_slow").filter(|&b| b != 0.0).unwrap_or(1.0),
            original_max_position: original,
            truncate: r.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            attn_factor: attn_factor as f32,
        })
    }

    /// Per-frequency divisors of `θ^(-2i/dims)` (the form of
    /// [`hf2q_tensor::op::RopeParams::freq_factors`]), `dims / 2` values.
    pub fn freq_factors(&self, theta: f64, dims: usize) -> Vec<f32> {
        let d = dims as f64;
        let correction_dim = |rot: f64| {
            d * (self.original_max_position / (rot * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (
            correction_dim(self.beta_fast),
            correction_dim(self.beta_slow),
        );
        if self.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..dims / 2)
            .map(|i| {
                let base = theta.powf(-(2.0 * i as f64) / d);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                // The share of the original (extrapolated) frequency.
                let extrapolation = 1.0 - ramp;
                let inv = base / self.factor * (1.0 - extrapolation) + base * extrapolation;
                (base / inv) as f32
            })
            .collect()
    }
}

/// The routed experts of a GPT-OSS config: `num_local_experts`, `num_experts_per_tok`, the
/// expert width in `intermediate_size`, every layer routed, the chosen k softmaxed (the
/// renormalised softmax), the clamped SwiGLU at `swiglu_limit` (7 when absent).
pub(super) fn moe_from_hf(v: &Value, n_layers: usize) -> Result<MoeConfig> {
    let u = |k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as usize);
    let need = |k: &str| u(k).ok_or_else(|| bad(format!("config.json lacks '{k}'")));
    let limit = v.get("swiglu_limit").and_then(Value::as_f64).unwrap_or(7.0) as f32;
    if !(limit > 0.0 && limit.is_finite()) {
        return Err(bad(format!("swiglu_limit {limit} is out of range")));
    }
    Ok(MoeConfig {
        n_experts: need("num_local_experts")?,
        n_used: need("num_experts_per_tok")?,
        expert_width: need("intermediate_size")?,
        renormalize: true,
        layers: vec![true; n_layers],
        clamped_swiglu: Some(limit),
    })
}

/// GPT-OSS's settings from a GGUF of architecture `a` (`gpt-oss`), on top of the common ones
/// [`ModelConfig::from_gguf`] read: q/k/v/o biases and sinks; llama.cpp's sliding pattern
/// (`set_swa_pattern(2)`: even layers slide, as GPT-OSS's `layer_types`); YaRN from
/// `rope.scaling.{factor,original_context_length,yarn_beta_fast,yarn_beta_slow}`; the experts'
/// clamped SwiGLU at 7 (llama.cpp's fixed limit; GGUF has no key) with a renormalised top-k.
///
/// YaRN's ramp is not truncated: GPT-OSS sets `truncate: false`, which the reference
/// implementation and transformers follow; llama.cpp's YaRN rounds the correction dims (it has
/// no key for it), so it differs slightly there. hf2q keeps the model's own behaviour, so a
/// GGUF gives the same logits as the Hugging Face folder.
pub(super) fn from_gguf(c: &mut ModelConfig, g: &GgufFile, a: &str) -> Result<()> {
    let key = |k: &str| format!("{a}.{k}");
    let f = |k: &str| g.get_f32(&key(k)).map(f64::from);
    c.attention_bias = true;
    c.attention_sinks = true;
    if c.sliding_window.is_some() {
        c.sliding_layers = (0..c.n_layers).map(|i| i % 2 == 0).collect();
    }
    c.yarn = match g.get_str(&key("rope.scaling.type")) {
        None | Some("none") => None,
        Some("yarn") => {
            let mut r = serde_json::Map::new();
            for (gk, hk) in [
                ("rope.scaling.factor", "factor"),
                (
                    "rope.scaling.original_context_length",
                    "original_max_position_embeddings",
                ),
                ("rope.scaling.yarn_beta_fast", "beta_fast"),
                ("rope.scaling.yarn_beta_slow", "beta_slow"),
                ("rope.scaling.yarn_attn_factor", "attention_factor"),
            ] {
                let v = match gk {
                    "rope.scaling.original_context_length" => g.get_u64(&key(gk)).map(|x| x as f64),
                    _ => f(gk),
                };
                if let Some(v) = v {
                    r.insert(hk.into(), v.into());
                }
            }
            r.insert("truncate".into(), false.into());
            Some(Yarn::from_hf(&Value::Object(r), c.context_length)?)
        }
        Some(t) => {
            return Err(bad(format!(
                "GPT-OSS GGUF with RoPE scaling '{t}' is not supported (yarn or none)"
            )))
        }
    };
    let m = c.moe.as_mut().ok_or_else(|| {
        bad(format!(
            "GGUF lacks '{}' (GPT-OSS is routed)",
            key("expert_count")
        ))
    })?;
    m.renormalize = true;
    m.clamped_swiglu = Some(7.0);
    Ok(())
}

/// Refuses what this loader does not run: experts quantized other than as MXFP4 (a
/// dequantized checkpoint has no `quantization_config` and is refused when its experts are
/// read).
pub(super) fn check_hf(v: &Value) -> Result<()> {
    if let Some(q) = v.get("quantization_config").filter(|q| !q.is_null()) {
        let m = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        if m != "mxfp4" {
            return Err(bad(format!(
                "GPT-OSS with quantization method '{m}' is not supported (MXFP4 experts only)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, ModelConfig};
    use serde_json::json;

    /// transformers' `_compute_yarn_parameters` for GPT-OSS-20B's settings (head 64, θ 150000,
    /// factor 32, original context 4096, β 32/1, truncate false), written out in f64 here as
    /// its formulas read: the divisors are 1 for the fast frequencies, `factor` for the slow.
    #[test]
    fn yarn_blends_between_the_correction_dims() {
        let r = json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 4096, "truncate": false});
        let y = Yarn::from_hf(&r, 131072).unwrap();
        assert_eq!(y.factor, 32.0);
        assert!((y.attn_factor as f64 - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-6);
        let f = y.freq_factors(150000.0, 64);
        assert_eq!(f.len(), 32);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[31], 32.0);
        // Between the ends: low = 64 ln(4096 / 64π) / (2 ln 150000) ≈ 8.09.
        let low =
            64.0 * (4096.0 / (32.0 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * 150000f64.ln());
        let high = 64.0 * (4096.0 / (2.0 * std::f64::consts::PI)).ln() / (2.0 * 150000f64.ln());
        let i = 12usize;
        let ramp = (i as f64 - low) / (high - low);
        let want = 1.0 / ((1.0 - ramp) + ramp / 32.0);
        assert!((f[i] as f64 - want).abs() < 1e-5, "{} vs {want}", f[i]);
        // No original context: the factor as written; truncation on by default.
        let y = Yarn::from_hf(&json!({"factor": 4.0}), 2048).unwrap();
        assert_eq!(
            (y.factor, y.original_max_position, y.truncate),
            (4.0, 2048.0, true)
        );
        assert!(Yarn::from_hf(&json!({}), 2048).is_err());
    }

    /// The tiny fixture's config.json (transformers 5.17's `GptOssConfig.to_dict()`).
    #[test]
    fn tiny_gpt_oss_config() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/tiny/tiny-gpt-oss/config.json"
        );
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.arch, Arch::GptOss);
        assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (4, 2, 16));
        assert_eq!(c.sliding_window, Some(4));
        assert_eq!(c.sliding_layers, vec![true, false]);
        assert!(c.attention_bias && c.attention_sinks && !c.tie_embeddings);
        assert_eq!(c.rope_theta, 150000.0);
        let y = c.yarn.as_ref().unwrap();
        assert_eq!(
            (y.factor, y.original_max_position, y.truncate),
            (4.0, 64.0, false)
        );
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.n_experts, m.n_used, m.expert_width), (4, 2, 32));
        assert_eq!((m.renormalize, m.clamped_swiglu), (true, Some(7.0)));
        assert_eq!(m.layers, vec![true, true]);
        // Other quantization methods of the experts are refused by name.
        let mut w = v.clone();
        w["quantization_config"]["quant_method"] = "fp8".into();
        let e = ModelConfig::from_hf_json(&w).unwrap_err().to_string();
        assert!(e.contains("quantization method 'fp8'"), "{e}");
    }
}
