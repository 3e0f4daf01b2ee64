//! The one table mapping checkpoint tensor names (Hugging Face style, used everywhere inside
//! hf2q) to GGUF names (llama.cpp's `tensor_mapping`). Architecture code asks for HF names.

use crate::config::Arch;

/// Global (non-layer) tensors.
const GLOBAL: &[(&str, &str)] = &[
    ("model.embed_tokens", "token_embd"),
    ("model.norm", "output_norm"),
    ("lm_head", "output"),
    ("rope_freqs", "rope_freqs"),
    // LongRoPE's per-frequency divisors (Phi-3 / Phi-4), as llama.cpp stores them.
    ("rope_factors_short", "rope_factors_short"),
    ("rope_factors_long", "rope_factors_long"),
    // Gemma 4's per-layer embeddings (E2B/E4B).
    ("model.embed_tokens_per_layer", "per_layer_token_embd"),
    ("model.per_layer_model_projection", "per_layer_model_proj"),
    ("model.per_layer_projection_norm", "per_layer_proj_norm"),
];

/// Per-layer tensors: HF suffix after `model.layers.N.` -> GGUF suffix after `blk.N.`.
const LAYER: &[(&str, &str)] = &[
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    // Phi-3's fused products (its fused gate/up is `ffn_up`, see `hf_to_gguf`).
    ("self_attn.qkv_proj", "attn_qkv"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
    // Routed experts: the router (Qwen3-MoE's name, and Mixtral's), and the experts stacked
    // (one 3-D tensor each; checkpoints store them per expert or fused, see `source.rs`).
    ("mlp.gate", "ffn_gate_inp"),
    ("block_sparse_moe.gate", "ffn_gate_inp"),
    ("mlp.experts.gate_proj", "ffn_gate_exps"),
    ("mlp.experts.up_proj", "ffn_up_exps"),
    ("mlp.experts.down_proj", "ffn_down_exps"),
];

/// Gemma 4's own per-layer tensors (llama.cpp's `gemma4` names), looked up before [`LAYER`]:
/// the routed branch beside the MLP (router, its input scale, the per-expert scale, the experts
/// fused as transformers stores them, or gate and up apart), its norms, and the layer scalar.
/// Stems are whole (no `.weight` split) where the HF name has no `.weight`.
const GEMMA4_LAYER: &[(&str, &str)] = &[
    (
        "post_attention_layernorm.weight",
        "post_attention_norm.weight",
    ),
    (
        "pre_feedforward_layernorm_2.weight",
        "pre_ffw_norm_2.weight",
    ),
    (
        "post_feedforward_layernorm_1.weight",
        "post_ffw_norm_1.weight",
    ),
    (
        "post_feedforward_layernorm_2.weight",
        "post_ffw_norm_2.weight",
    ),
    ("router.proj.weight", "ffn_gate_inp.weight"),
    ("router.scale", "ffn_gate_inp.scale"),
    ("router.per_expert_scale", "ffn_down_exps.scale"),
    ("experts.gate_up_proj", "ffn_gate_up_exps.weight"),
    ("experts.gate_proj", "ffn_gate_exps.weight"),
    ("experts.up_proj", "ffn_up_exps.weight"),
    ("experts.down_proj", "ffn_down_exps.weight"),
    ("layer_scalar", "layer_output_scale.weight"),
    ("per_layer_input_gate.weight", "inp_gate.weight"),
    ("per_layer_projection.weight", "proj.weight"),
    ("post_per_layer_input_norm.weight", "post_norm.weight"),
];

/// Maps an HF tensor name (`model.layers.3.self_attn.q_proj.weight`) to its GGUF name
/// (`blk.3.attn_q.weight`), or `None` if the table has no entry.
pub fn hf_to_gguf(arch: Arch, hf: &str) -> Option<String> {
    let (stem, suffix) = match hf.rsplit_once('.') {
        Some((s, x)) if x == "weight" || x == "bias" => (s, x),
        _ => (hf, ""),
    };
    let dot_suffix = if suffix.is_empty() {
        String::new()
    } else {
        format!(".{suffix}")
    };
    if let Some((_, g)) = GLOBAL.iter().find(|(h, _)| *h == stem) {
        return Some(format!("{g}{dot_suffix}"));
    }
    if arch == Arch::Gemma4 {
        let (idx, whole) = hf.strip_prefix("model.layers.")?.split_once('.')?;
        idx.parse::<usize>().ok()?;
        if let Some((_, g)) = GEMMA4_LAYER.iter().find(|(h, _)| *h == whole) {
            return Some(format!("blk.{idx}.{g}"));
        }
    }
    let rest = stem.strip_prefix("model.layers.")?;
    let (idx, part) = rest.split_once('.')?;
    idx.parse::<usize>().ok()?;
    if arch == Arch::GptOss {
        // llama.cpp's `gpt-oss` names: the sinks gain a `.weight`, the router is `ffn_gate_inp`.
        match part {
            "self_attn.sinks" if suffix.is_empty() => {
                return Some(format!("blk.{idx}.attn_sinks.weight"))
            }
            "mlp.router" => return Some(format!("blk.{idx}.ffn_gate_inp{dot_suffix}")),
            _ => {}
        }
    }
    // The one name whose meaning differs by family: Llama's "post attention" norm is the norm
    // before the MLP; Gemma 3's and OLMo 2's is applied to the attention output. GPT-OSS's is
    // Llama's norm but llama.cpp names it `post_attention_norm` (its `gpt-oss` tensor list has
    // no `ffn_norm`).
    let g = if part == "mlp.gate_up_proj" && arch == Arch::Phi3 {
        "ffn_up"
    } else if part == "post_attention_layernorm" {
        if matches!(arch, Arch::Gemma3 | Arch::Olmo2 | Arch::GptOss) {
            "post_attention_norm"
        } else {
            "ffn_norm"
        }
    } else {
        LAYER.iter().find(|(h, _)| *h == part)?.1
    };
    Some(format!("blk.{idx}.{g}{dot_suffix}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn maps_known_names() {
        assert_eq!(
            hf_to_gguf(Arch::Llama, "model.embed_tokens.weight").unwrap(),
            "token_embd.weight"
        );
        assert_eq!(
            hf_to_gguf(Arch::Llama, "model.layers.3.self_attn.q_proj.weight").unwrap(),
            "blk.3.attn_q.weight"
        );
        assert_eq!(
            hf_to_gguf(Arch::Qwen2, "model.layers.0.self_attn.k_proj.bias").unwrap(),
            "blk.0.attn_k.bias"
        );
        assert_eq!(
            hf_to_gguf(
                Arch::Llama,
                "model.layers.1.post_attention_layernorm.weight"
            )
            .unwrap(),
            "blk.1.ffn_norm.weight"
        );
        assert_eq!(
            hf_to_gguf(
                Arch::Gemma3,
                "model.layers.1.post_attention_layernorm.weight"
            )
            .unwrap(),
            "blk.1.post_attention_norm.weight"
        );
        assert_eq!(
            hf_to_gguf(
                Arch::Gemma3,
                "model.layers.1.pre_feedforward_layernorm.weight"
            )
            .unwrap(),
            "blk.1.ffn_norm.weight"
        );
        assert_eq!(
            hf_to_gguf(Arch::Llama, "lm_head.weight").unwrap(),
            "output.weight"
        );
        assert!(hf_to_gguf(Arch::Llama, "model.layers.x.mlp.up_proj.weight").is_none());
        // llama.cpp's names for the Llama variants' own tensors.
        for (arch, hf, g) in [
            (
                Arch::Phi3,
                "model.layers.0.self_attn.qkv_proj.weight",
                "blk.0.attn_qkv.weight",
            ),
            (
                Arch::Phi3,
                "model.layers.0.mlp.gate_up_proj.weight",
                "blk.0.ffn_up.weight",
            ),
            (
                Arch::Olmo2,
                "model.layers.1.post_attention_layernorm.weight",
                "blk.1.post_attention_norm.weight",
            ),
            (
                Arch::Olmo2,
                "model.layers.1.post_feedforward_layernorm.weight",
                "blk.1.post_ffw_norm.weight",
            ),
            (
                Arch::Olmo2,
                "model.layers.1.self_attn.q_norm.weight",
                "blk.1.attn_q_norm.weight",
            ),
            (
                Arch::Granite,
                "model.layers.1.post_attention_layernorm.weight",
                "blk.1.ffn_norm.weight",
            ),
        ] {
            assert_eq!(hf_to_gguf(arch, hf).as_deref(), Some(g), "{hf}");
        }
        for (hf, g) in [
            ("model.layers.2.router.scale", "blk.2.ffn_gate_inp.scale"),
            (
                "model.layers.2.router.proj.weight",
                "blk.2.ffn_gate_inp.weight",
            ),
            (
                "model.layers.0.router.per_expert_scale",
                "blk.0.ffn_down_exps.scale",
            ),
            (
                "model.layers.1.experts.gate_up_proj",
                "blk.1.ffn_gate_up_exps.weight",
            ),
            (
                "model.layers.1.layer_scalar",
                "blk.1.layer_output_scale.weight",
            ),
            (
                "model.layers.1.post_attention_layernorm.weight",
                "blk.1.post_attention_norm.weight",
            ),
            (
                "model.layers.1.pre_feedforward_layernorm_2.weight",
                "blk.1.pre_ffw_norm_2.weight",
            ),
            (
                "model.layers.1.pre_feedforward_layernorm.weight",
                "blk.1.ffn_norm.weight",
            ),
            (
                "model.layers.1.post_feedforward_layernorm.weight",
                "blk.1.post_ffw_norm.weight",
            ),
            (
                "model.layers.1.self_attn.k_norm.weight",
                "blk.1.attn_k_norm.weight",
            ),
        ] {
            assert_eq!(hf_to_gguf(Arch::Gemma4, hf).as_deref(), Some(g), "{hf}");
        }
        for (hf, g) in [
            ("model.layers.1.self_attn.sinks", "blk.1.attn_sinks.weight"),
            (
                "model.layers.1.mlp.router.weight",
                "blk.1.ffn_gate_inp.weight",
            ),
            ("model.layers.1.mlp.router.bias", "blk.1.ffn_gate_inp.bias"),
            (
                "model.layers.0.post_attention_layernorm.weight",
                "blk.0.post_attention_norm.weight",
            ),
            (
                "model.layers.0.mlp.experts.gate_proj.bias",
                "blk.0.ffn_gate_exps.bias",
            ),
            (
                "model.layers.0.self_attn.o_proj.bias",
                "blk.0.attn_output.bias",
            ),
        ] {
            assert_eq!(hf_to_gguf(Arch::GptOss, hf).as_deref(), Some(g), "{hf}");
        }
        assert_eq!(
            hf_to_gguf(Arch::Llama, "model.layers.2.block_sparse_moe.gate.weight").unwrap(),
            "blk.2.ffn_gate_inp.weight"
        );
        assert_eq!(
            hf_to_gguf(
                Arch::Qwen3Moe,
                "model.layers.0.mlp.experts.down_proj.weight"
            )
            .unwrap(),
            "blk.0.ffn_down_exps.weight"
        );
    }
}
