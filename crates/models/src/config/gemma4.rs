//! Gemma 4's config: what a Hugging Face `config.json` (the text model, `text_config` of a
//! multimodal checkpoint) and llama.cpp's `gemma4.*` GGUF keys say beyond the common fields
//! [`super::ModelConfig::from_hf_json`] and [`super::ModelConfig::from_gguf`] read.
//! Reference: transformers' `configuration_gemma4.py` (`Gemma4TextConfig`) and llama.cpp's
//! `gemma4` loader.
//!
//! Refused with a message: bidirectional attention of every token
//! (`use_bidirectional_attention: "all"`; `"vision"` concerns image tokens only).

use hf2q_tensor::io::gguf::GgufFile;
use serde_json::Value;

use super::{bad, Gemma4Config, ModelConfig, MoeConfig};
use crate::Result;

/// KV-shared layers: each of the last `shared` layers attends over the keys and values of the
/// last unshared layer of its kind (sliding or global), as transformers' `Gemma4TextAttention`.
fn kv_sources(sliding: &[bool], shared: usize) -> Result<Vec<Option<usize>>> {
    let n = sliding.len();
    if shared >= n && shared > 0 {
        return Err(bad(format!(
            "{shared} KV-shared layers of {n}: no layer computes keys and values"
        )));
    }
    let first = n - shared;
    (0..n)
        .map(|i| {
            if i < first {
                return Ok(None);
            }
            (0..first)
                .rev()
                .find(|&j| sliding[j] == sliding[i])
                .map(Some)
                .ok_or_else(|| {
                    bad(format!(
                        "KV-shared layer {i} has no earlier layer of its kind to share"
                    ))
                })
        })
        .collect()
}

/// Fills the Gemma 4 parts of `c` (parsed as a Gemma from the common keys) from `config.json`.
pub(super) fn from_hf(c: &mut ModelConfig, v: &Value) -> Result<()> {
    let u = |k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as usize);
    // "vision" lets image tokens see each other; text alone stays causal, as here. "all"
    // makes every token see every other (an encoder): not a causal model.
    if let Some(b) = v
        .get("use_bidirectional_attention")
        .and_then(Value::as_str)
        .filter(|&b| b != "vision")
    {
        return Err(bad(format!(
            "Gemma 4 with use_bidirectional_attention = '{b}' is not supported"
        )));
    }
    if let Some(a) = v.get("hidden_activation").and_then(Value::as_str) {
        if a != "gelu_pytorch_tanh" {
            return Err(bad(format!("Gemma 4 activation '{a}' is not supported")));
        }
    }
    // transformers' defaults where the file is silent (files it writes name every field).
    c.head_dim = u("head_dim").unwrap_or(256);
    c.sliding_window = Some(u("sliding_window").unwrap_or(512));
    if v.get("rope_parameters").is_none_or(|r| !r.is_object()) {
        c.rope_theta = 1_000_000.0;
        c.rope_theta_local = Some(10000.0);
    }
    // The last layer is global whatever `layer_types` says, as transformers forces it.
    if let Some(last) = c.sliding_layers.last_mut() {
        *last = false;
    }
    let k_eq_v = v.get("attention_k_eq_v").and_then(Value::as_bool) == Some(true);
    // Global layers: `per_layer_config` as transformers 5.17 writes it (layer index -> its
    // head_dim and kv heads), else `global_head_dim` (512 when absent, as transformers has it)
    // and, with keys as values, `num_global_key_value_heads`.
    let plc = v.get("per_layer_config").and_then(Value::as_object);
    let global_dh = u("global_head_dim").unwrap_or(512);
    let global_kv = if k_eq_v {
        u("num_global_key_value_heads")
    } else {
        None
    };
    c.layer_heads = (0..c.n_layers)
        .map(|i| {
            let base = (c.n_kv_heads, c.head_dim);
            match plc {
                Some(p) => {
                    let Some(o) = p.get(&i.to_string()) else {
                        return base;
                    };
                    let g = |k: &str| o.get(k).and_then(Value::as_u64).map(|x| x as usize);
                    (
                        g("num_key_value_heads").unwrap_or(base.0),
                        g("head_dim").unwrap_or(base.1),
                    )
                }
                None if !c.sliding_layers[i] => (global_kv.unwrap_or(base.0), global_dh),
                None => base,
            }
        })
        .collect();
    // RoPE of global layers: proportional (a fraction rotated, the rest left as is) or default.
    let full = v
        .get("rope_parameters")
        .and_then(|r| r.get("full_attention"))
        .filter(|r| r.is_object());
    let (partial, factor) = match full {
        Some(r) => {
            let ty = r
                .get("rope_type")
                .and_then(Value::as_str)
                .unwrap_or("default");
            let f = |k: &str| r.get(k).and_then(Value::as_f64).map(|x| x as f32);
            match ty {
                "proportional" => (
                    f("partial_rotary_factor").unwrap_or(1.0),
                    f("factor").unwrap_or(1.0),
                ),
                "default" => (1.0, 1.0),
                t => return Err(bad(format!("unsupported Gemma 4 RoPE type '{t}'"))),
            }
        }
        None => (0.25, 1.0),
    };
    if let Some(r) = v
        .get("rope_parameters")
        .and_then(|r| r.get("sliding_attention"))
        .and_then(|r| r.get("rope_type"))
        .and_then(Value::as_str)
    {
        if r != "default" {
            return Err(bad(format!(
                "unsupported Gemma 4 sliding-layer RoPE type '{r}'"
            )));
        }
    }
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(bad(format!(
            "partial_rotary_factor {partial} is out of range"
        )));
    }
    c.rope_linear_factor = factor;
    let per_layer_width = u("hidden_size_per_layer_input").unwrap_or(256);
    if per_layer_width > 0 && u("vocab_size_per_layer_input").is_some_and(|pv| pv < c.vocab_size) {
        return Err(bad(
            "vocab_size_per_layer_input is smaller than vocab_size: some tokens would have no \
             per-layer embedding",
        ));
    }
    c.gemma4 = Some(Gemma4Config {
        k_eq_v,
        global_partial_rotary: partial,
        kv_source: kv_sources(&c.sliding_layers, u("num_kv_shared_layers").unwrap_or(0))?,
        per_layer_width,
    });
    c.norm_offset = 0.0;
    c.attn_scale = 1.0;
    c.rope_theta_local = Some(c.rope_theta_local.unwrap_or(10000.0));
    c.moe = if v.get("enable_moe_block").and_then(Value::as_bool) == Some(true) {
        let need = |k: &str| u(k).ok_or_else(|| bad(format!("config.json lacks '{k}'")));
        Some(MoeConfig {
            n_experts: need("num_experts")?,
            n_used: need("top_k_experts")?,
            expert_width: need("moe_intermediate_size")?,
            renormalize: true,
            layers: vec![true; c.n_layers],
            clamped_swiglu: None,
        })
    } else {
        None
    };
    Ok(())
}

/// Fills the Gemma 4 parts of `c` from llama.cpp's `gemma4.*` keys: per-layer kv heads
/// (`attention.head_count_kv`, a number or one per layer), sliding layers
/// (`attention.sliding_window_pattern`, one bool per layer), head widths (`key_length` of
/// global layers, `key_length_swa` of sliding ones), `rope.freq_base_swa`. Keys as values are
/// found per layer by a missing `attn_v`; proportional RoPE comes as `rope_freqs.weight`.
pub(super) fn from_gguf(c: &mut ModelConfig, g: &GgufFile) -> Result<()> {
    let key = |k: &str| format!("gemma4.{k}");
    let u = |k: &str| g.get_u64(&key(k)).map(|x| x as usize);
    let n = c.n_layers;
    let per_layer = |k: &str| -> Option<Vec<usize>> {
        let a = g.get_array(&key(k))?;
        (a.len() == n)
            .then(|| {
                a.values
                    .iter()
                    .map(|x| x.as_u64().map(|y| y as usize))
                    .collect()
            })
            .flatten()
    };
    if let Some(a) = g.get_array(&key("attention.sliding_window_pattern")) {
        let s: Option<Vec<bool>> = a.values.iter().map(|x| x.as_bool()).collect();
        match s {
            Some(s) if s.len() == n => c.sliding_layers = s,
            _ => {
                return Err(bad(format!(
                    "{} is not one bool per layer",
                    key("attention.sliding_window_pattern")
                )))
            }
        }
    }
    let kv = per_layer("attention.head_count_kv");
    let global_dh = u("attention.key_length").unwrap_or(c.head_dim);
    let swa_dh = u("attention.key_length_swa").unwrap_or(global_dh);
    c.layer_heads = (0..n)
        .map(|i| {
            let h = kv.as_ref().map_or(c.n_kv_heads, |k| k[i]);
            (
                h,
                if c.sliding_layers[i] {
                    swa_dh
                } else {
                    global_dh
                },
            )
        })
        .collect();
    // The common fields speak of the sliding layers (the first layer is one in every Gemma 4).
    c.n_kv_heads = c.layer_heads[0].0;
    c.head_dim = c.layer_heads[0].1;
    c.rope_theta_local = Some(g.get_f32(&key("rope.freq_base_swa")).unwrap_or(10000.0));
    c.norm_offset = 0.0;
    c.attn_scale = 1.0;
    let kv_source = kv_sources(
        &c.sliding_layers,
        u("attention.shared_kv_layers").unwrap_or(0),
    )?;
    c.gemma4 = Some(Gemma4Config {
        // Where an unshared global layer has no `attn_v`.
        k_eq_v: (0..n).any(|i| {
            !c.sliding_layers[i]
                && kv_source[i].is_none()
                && g.tensor(&format!("blk.{i}.attn_v.weight")).is_none()
        }),
        // The rotated fraction is in `rope_freqs.weight` (loaded by the blocks).
        global_partial_rotary: 1.0,
        kv_source,
        per_layer_width: u("embedding_length_per_layer_input").unwrap_or(0),
    });
    if let Some(m) = c.moe.as_mut() {
        m.renormalize = true;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{Arch, ModelConfig};
    use serde_json::json;

    fn text(extra: serde_json::Value) -> serde_json::Value {
        let mut t = json!({
            "model_type": "gemma4_text", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
            "hidden_size_per_layer_input": 0,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        });
        for (k, x) in extra.as_object().unwrap() {
            t[k] = x.clone();
        }
        // As a multimodal checkpoint nests it.
        json!({ "model_type": "gemma4", "text_config": t })
    }

    #[test]
    fn global_layers_from_either_form() {
        // transformers 5.17's per_layer_config.
        let c = ModelConfig::from_hf_json(&text(json!({"attention_k_eq_v": true,
            "per_layer_config": {"2": {"head_dim": 32, "num_key_value_heads": 1}}})))
        .unwrap();
        assert_eq!(c.arch, Arch::Gemma4);
        assert_eq!(c.layer_heads, vec![(2, 16), (2, 16), (1, 32)]);
        assert_eq!((c.attn_scale, c.norm_offset), (1.0, 0.0));
        let g = c.gemma4.unwrap();
        assert!(g.k_eq_v);
        // No rope_parameters: transformers' defaults (a quarter rotated).
        assert_eq!(g.global_partial_rotary, 0.25);
        // Earlier files: global_head_dim, and the global kv heads only with keys as values.
        let c = ModelConfig::from_hf_json(&text(json!({"attention_k_eq_v": true,
            "global_head_dim": 64, "num_global_key_value_heads": 1})))
        .unwrap();
        assert_eq!(c.layer_heads[2], (1, 64));
        let c = ModelConfig::from_hf_json(&text(json!({"global_head_dim": 64,
            "num_global_key_value_heads": 1})))
        .unwrap();
        assert_eq!(c.layer_heads[2], (2, 64));
        assert!(c.moe.is_none());
        // transformers' defaults: head width 256, window 512, per-layer embeddings of 256,
        // every 6th layer global and the last one too, global θ 10⁶.
        let c = ModelConfig::from_hf_json(&json!({"model_type": "gemma4_text",
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2}))
        .unwrap();
        assert_eq!((c.head_dim, c.sliding_window), (256, Some(512)));
        assert_eq!(c.gemma4.as_ref().unwrap().per_layer_width, 256);
        let globals: Vec<usize> = (0..8).filter(|&i| !c.sliding_layers[i]).collect();
        assert_eq!(globals, vec![5, 7]);
        assert_eq!((c.rope_theta, c.rope_theta_local), (1e6, Some(1e4)));
        assert_eq!(c.layer_heads[5], (2, 512));
        // Six sliding layers of 2 x 256 and two global ones of 2 x 512, keys and values.
        assert_eq!(c.kv_values_per_token(), 2 * (6 * 2 * 256 + 2 * 2 * 512));
        // KV sharing: the last two layers read the last unshared layer of their kind.
        let c = ModelConfig::from_hf_json(&text(json!({"num_hidden_layers": 5,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                "sliding_attention", "full_attention"], "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8})))
        .unwrap();
        let g = c.gemma4.unwrap();
        assert_eq!(g.kv_source, vec![None, None, None, Some(2), Some(1)]);
        assert_eq!(g.per_layer_width, 8);
    }

    /// A multimodal config as the 26B-A4B's is laid out (text model under `text_config`,
    /// written by an earlier transformers: `global_head_dim`, no `per_layer_config`).
    #[test]
    fn a_26b_a4b_like_config() {
        let mut lt = vec!["sliding_attention"; 30];
        for i in (5..30).step_by(6) {
            lt[i] = "full_attention";
        }
        let v = json!({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
            "vision_config": {"model_type": "gemma4_vision", "hidden_size": 1152},
            "audio_config": null, "tie_word_embeddings": true,
            "text_config": {"model_type": "gemma4_text", "attention_k_eq_v": true,
                "enable_moe_block": true, "final_logit_softcapping": 30.0, "global_head_dim": 512,
                "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2816,
                "hidden_size_per_layer_input": 0, "intermediate_size": 2112, "layer_types": lt,
                "max_position_embeddings": 262144, "moe_intermediate_size": 704,
                "num_attention_heads": 16, "num_experts": 128, "num_global_key_value_heads": 2,
                "num_hidden_layers": 30, "num_key_value_heads": 8, "num_kv_shared_layers": 0,
                "rms_norm_eps": 1e-6, "sliding_window": 1024, "top_k_experts": 8,
                "use_bidirectional_attention": "vision", "vocab_size": 262144,
                "vocab_size_per_layer_input": 262144,
                "rope_parameters": {
                    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                        "rope_type": "proportional"},
                    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}}});
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.arch, Arch::Gemma4);
        assert_eq!((c.layer_heads[0], c.layer_heads[5]), ((8, 256), (2, 512)));
        assert_eq!(c.sliding_window, Some(1024));
        assert_eq!((c.rope_theta, c.rope_theta_local), (1e6, Some(1e4)));
        assert_eq!(c.final_logit_softcap, Some(30.0));
        assert!(c.tie_embeddings);
        let m = c.moe.unwrap();
        assert_eq!((m.n_experts, m.n_used, m.expert_width), (128, 8, 704));
        let g = c.gemma4.unwrap();
        assert!(g.k_eq_v && g.kv_source.iter().all(Option::is_none));
        assert_eq!((g.global_partial_rotary, g.per_layer_width), (0.25, 0));
    }

    #[test]
    fn routed_branch_and_refusals() {
        let c = ModelConfig::from_hf_json(&text(json!({"enable_moe_block": true,
            "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32})))
        .unwrap();
        let m = c.moe.unwrap();
        assert_eq!((m.n_experts, m.n_used, m.expert_width), (8, 2, 32));
        assert!(m.renormalize && m.layers.iter().all(|&r| r));
        for (extra, want) in [
            (json!({"num_kv_shared_layers": 3}), "no layer computes keys"),
            (
                json!({"use_bidirectional_attention": "all"}),
                "use_bidirectional_attention = 'all'",
            ),
            (
                json!({"layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
                    "num_kv_shared_layers": 2}),
                "no earlier layer of its kind",
            ),
            (
                json!({"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 50}),
                "vocab_size_per_layer_input",
            ),
            (
                json!({"enable_moe_block": true, "num_experts": 8}),
                "top_k_experts",
            ),
            (
                json!({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}),
                "RoPE type 'yarn'",
            ),
            (
                json!({"per_layer_config": {"2": {"num_key_value_heads": 3}}}),
                "not a multiple of 3",
            ),
        ] {
            let e = ModelConfig::from_hf_json(&text(extra)).unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
        }
    }
}
