//! MiniCPM's config (`MiniCPMForCausalLM`, model_type `minicpm`: MiniCPM-1B/2B and their
//! fine-tunes): a Llama whose embeddings are multiplied by `scale_emb`, whose block halves join
//! the residual multiplied by `scale_depth / sqrt(num_hidden_layers)`, and whose final hidden
//! state is divided by `hidden_size / dim_model_base` before the head. These are Granite's
//! embedding, residual and logit multipliers ([`ModelConfig::embed_scale`],
//! [`ModelConfig::residual_scale`], [`ModelConfig::logit_scale`]), so the Llama block runs it.
//! Reference: the published `modeling_minicpm.py` (remote code, no transformers class) and
//! llama.cpp's `minicpm` (its converter's `embedding_scale`, `residual_scale` and
//! `logit_scale` keys, the last a divisor; q/k rows permuted as Llama's).
//!
//! Refused by name (not proven against a reference here): MiniCPM4's LongRoPE and its sparse
//! attention (`sparse_config`, InfLLM v2), `use_mup: false`, activations other than SiLU, and
//! MiniCPM-MoE's experts. MiniCPM3 (`minicpm3`, latent attention) is another model_type and
//! refused as unsupported. MiniCPM5 is a plain `LlamaForCausalLM` (model_type `llama`), read as
//! Llama.

use hf2q_tensor::io::gguf::GgufFile;
use serde_json::Value;

use super::{bad, ModelConfig};
use crate::Result;

/// Refuses the MiniCPM variants this loader does not run, naming what it found.
pub(super) fn check_hf(v: &Value) -> Result<()> {
    let rope = v
        .get("rope_scaling")
        .or_else(|| v.get("rope_parameters"))
        .filter(|r| r.is_object())
        .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
        .and_then(Value::as_str);
    if let Some(t) = rope.filter(|t| *t != "default") {
        return Err(bad(format!(
            "MiniCPM with '{t}' RoPE scaling (MiniCPM4's LongRoPE) is not supported yet"
        )));
    }
    if v.get("sparse_config").is_some_and(|s| !s.is_null()) {
        return Err(bad(
            "MiniCPM4's sparse attention (sparse_config, InfLLM v2) is not supported yet",
        ));
    }
    if v.get("use_mup").and_then(Value::as_bool) == Some(false) {
        return Err(bad(
            "MiniCPM with use_mup: false is not supported yet (only the scaled form is)",
        ));
    }
    if let Some(a) = v.get("hidden_act").and_then(Value::as_str) {
        if a != "silu" {
            return Err(bad(format!(
                "MiniCPM with hidden_act '{a}' is not supported (SiLU only)"
            )));
        }
    }
    if v.get("num_experts")
        .and_then(Value::as_u64)
        .is_some_and(|e| e > 0)
    {
        return Err(bad("MiniCPM-MoE (num_experts) is not supported yet"));
    }
    Ok(())
}

/// The multipliers from config.json; absent ones take `MiniCPMConfig`'s defaults (1), and the
/// head is tied unless `tie_word_embeddings` says otherwise (MiniCPMConfig's default).
pub(super) fn from_hf(c: &mut ModelConfig, v: &Value) -> Result<()> {
    let f = |k: &str| v.get(k).and_then(Value::as_f64);
    let scale_emb = f("scale_emb").unwrap_or(1.0);
    let scale_depth = f("scale_depth").unwrap_or(1.0);
    let dim_model_base = f("dim_model_base").unwrap_or(1.0);
    if !dim_model_base.is_finite() || dim_model_base <= 0.0 || c.n_layers == 0 {
        return Err(bad(format!(
            "MiniCPM needs a positive dim_model_base (found {dim_model_base}) and at least one layer"
        )));
    }
    c.embed_scale = scale_emb as f32;
    c.residual_scale = (scale_depth / (c.n_layers as f64).sqrt()) as f32;
    c.logit_scale = (dim_model_base / c.hidden_size as f64) as f32;
    c.tie_embeddings = v
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    Ok(())
}

/// llama.cpp's `minicpm.*` keys; a file without them gets the values llama.cpp assumes for
/// older MiniCPM GGUFs (12, 1.4 / sqrt(layers), and a logit divisor of hidden / 256).
pub(super) fn from_gguf(c: &mut ModelConfig, g: &GgufFile) {
    let f = |k: &str| g.get_f32(&format!("minicpm.{k}"));
    c.embed_scale = f("embedding_scale").unwrap_or(12.0);
    c.residual_scale = f("residual_scale").unwrap_or(1.4 / (c.n_layers as f32).sqrt());
    c.logit_scale = 1.0 / f("logit_scale").unwrap_or(c.hidden_size as f32 / 256.0);
}

/// config.json's MiniCPM keys for `c` (the inverse of [`from_hf`]).
pub fn hf_keys(c: &ModelConfig) -> [(&'static str, f64); 3] {
    let n = c.n_layers as f64;
    [
        ("scale_emb", c.embed_scale as f64),
        ("scale_depth", c.residual_scale as f64 * n.sqrt()),
        (
            "dim_model_base",
            c.logit_scale as f64 * c.hidden_size as f64,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::{Arch, ModelConfig};

    fn cfg(extra: serde_json::Value) -> serde_json::Value {
        let mut v = serde_json::json!({"model_type": "minicpm", "vocab_size": 100,
            "hidden_size": 2304, "intermediate_size": 128, "num_hidden_layers": 40,
            "num_attention_heads": 36, "num_key_value_heads": 36, "scale_emb": 12,
            "scale_depth": 1.4, "dim_model_base": 256});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    #[test]
    fn minicpm_2b_multipliers() {
        // MiniCPM-2B's config.json (no tie_word_embeddings key: tied, as MiniCPMConfig says).
        let c = ModelConfig::from_hf_json(&cfg(serde_json::json!({}))).unwrap();
        assert_eq!(c.arch, Arch::MiniCpm);
        assert_eq!(c.embed_scale, 12.0);
        assert!((c.residual_scale - 1.4 / 40f32.sqrt()).abs() < 1e-7);
        assert_eq!(c.logit_scale, 256.0 / 2304.0);
        assert!(c.tie_embeddings);
        let keys = super::hf_keys(&c);
        assert_eq!(keys[0], ("scale_emb", 12.0));
        assert!((keys[1].1 - 1.4).abs() < 1e-6 && (keys[2].1 - 256.0).abs() < 1e-3);
        let c = ModelConfig::from_hf_json(&cfg(serde_json::json!({"tie_word_embeddings": false})))
            .unwrap();
        assert!(!c.tie_embeddings);
    }

    #[test]
    fn minicpm_variants_not_run_are_refused_by_name() {
        for (extra, want) in [
            (
                serde_json::json!({"rope_scaling": {"rope_type": "longrope",
                    "short_factor": [1.0], "long_factor": [1.0],
                    "original_max_position_embeddings": 32768}}),
                "MiniCPM4's LongRoPE",
            ),
            (
                serde_json::json!({"sparse_config": {"kernel_size": 32}}),
                "sparse_config",
            ),
            (serde_json::json!({"use_mup": false}), "use_mup"),
            (serde_json::json!({"hidden_act": "fatrelu"}), "fatrelu"),
            (serde_json::json!({"num_experts": 8}), "MiniCPM-MoE"),
        ] {
            let e = ModelConfig::from_hf_json(&cfg(extra))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        }
        // A null rope_scaling and sparse_config are the plain model.
        ModelConfig::from_hf_json(&cfg(
            serde_json::json!({"rope_scaling": null, "sparse_config": null}),
        ))
        .unwrap();
    }
}
