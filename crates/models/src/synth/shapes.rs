//! The model shapes `hf2q synth` knows: the dimensions, vocabulary size, RoPE settings and
//! experts of the upstream config.json of each model, turned into a [`ModelConfig`] by the
//! loader's own parser.

use serde_json::json;

use crate::config::{Arch, ModelConfig};
use crate::{Error, Result};

/// Llama 3 RoPE scaling parameters (`rope_scaling` of config.json).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Rope {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position: usize,
}

/// Routed experts of a shape (every layer routed, as in the models listed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthMoe {
    /// E
    pub n_experts: usize,
    /// k: experts per token.
    pub n_used: usize,
    /// F_e: the width of one expert (Mixtral: its `intermediate_size`).
    pub expert_width: usize,
    /// Qwen3-MoE's `norm_topk_prob` (Mixtral always renormalises).
    pub renormalize: bool,
}

/// A model's dimensions and the architecture settings that the GGUF metadata carries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthShape {
    pub name: &'static str,
    /// `Arch::Llama` (with experts: Mixtral), `Arch::Qwen3` or `Arch::Qwen3Moe`.
    pub arch: Arch,
    /// V; `None`: the tokenizer's own size.
    pub vocab_size: Option<usize>,
    /// D
    pub hidden_size: usize,
    /// F
    pub intermediate_size: usize,
    pub n_layers: usize,
    /// H
    pub n_heads: usize,
    /// Hkv
    pub n_kv_heads: usize,
    /// Dh
    pub head_dim: usize,
    pub context_length: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub tie_embeddings: bool,
    pub llama3_rope: Option<Llama3Rope>,
    pub moe: Option<SynthMoe>,
}

const LLAMA32_ROPE: Llama3Rope = Llama3Rope {
    factor: 32.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position: 8192,
};

/// The shapes `hf2q synth --shape` knows, with their upstream config.json values.
pub const SHAPES: &[SynthShape] = &[
    SynthShape {
        name: "llama-3.2-1b",
        arch: Arch::Llama,
        vocab_size: Some(128256),
        hidden_size: 2048,
        intermediate_size: 8192,
        n_layers: 16,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 64,
        context_length: 131072,
        rope_theta: 500000.0,
        rms_eps: 1e-5,
        tie_embeddings: true,
        llama3_rope: Some(LLAMA32_ROPE),
        moe: None,
    },
    SynthShape {
        name: "llama-3.2-3b",
        arch: Arch::Llama,
        vocab_size: Some(128256),
        hidden_size: 3072,
        intermediate_size: 8192,
        n_layers: 28,
        n_heads: 24,
        n_kv_heads: 8,
        head_dim: 128,
        context_length: 131072,
        rope_theta: 500000.0,
        rms_eps: 1e-5,
        tie_embeddings: true,
        llama3_rope: Some(LLAMA32_ROPE),
        moe: None,
    },
    SynthShape {
        name: "llama-3.1-8b",
        arch: Arch::Llama,
        vocab_size: Some(128256),
        hidden_size: 4096,
        intermediate_size: 14336,
        n_layers: 32,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        context_length: 131072,
        rope_theta: 500000.0,
        rms_eps: 1e-5,
        tie_embeddings: false,
        llama3_rope: Some(Llama3Rope {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        }),
        moe: None,
    },
    SynthShape {
        name: "qwen3-8b",
        arch: Arch::Qwen3,
        vocab_size: Some(151936),
        hidden_size: 4096,
        intermediate_size: 12288,
        n_layers: 36,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        context_length: 40960,
        rope_theta: 1000000.0,
        rms_eps: 1e-6,
        tie_embeddings: false,
        llama3_rope: None,
        moe: None,
    },
    // Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 per token, every layer routed.
    SynthShape {
        name: "qwen3-30b-a3b",
        arch: Arch::Qwen3Moe,
        vocab_size: Some(151936),
        hidden_size: 2048,
        intermediate_size: 6144,
        n_layers: 48,
        n_heads: 32,
        n_kv_heads: 4,
        head_dim: 128,
        context_length: 40960,
        rope_theta: 1000000.0,
        rms_eps: 1e-6,
        tie_embeddings: false,
        llama3_rope: None,
        moe: Some(SynthMoe {
            n_experts: 128,
            n_used: 8,
            expert_width: 768,
            renormalize: true,
        }),
    },
    // openai/gpt-oss-20b: 32 experts of width 2880, 4 per token, every layer routed; 64 query
    // and 8 kv heads of 64; even layers a 128-key window; YaRN 32 over 4096 positions (the
    // rest of GPT-OSS's settings, fixed for the family, in `SynthShape::config`).
    SynthShape {
        name: "gpt-oss-20b",
        arch: Arch::GptOss,
        vocab_size: Some(201088),
        hidden_size: 2880,
        intermediate_size: 2880,
        n_layers: 24,
        n_heads: 64,
        n_kv_heads: 8,
        head_dim: 64,
        context_length: 131072,
        rope_theta: 150000.0,
        rms_eps: 1e-5,
        tie_embeddings: false,
        llama3_rope: None,
        moe: Some(SynthMoe {
            n_experts: 32,
            n_used: 4,
            expert_width: 2880,
            renormalize: true,
        }),
    },
    // mistralai/Mixtral-8x7B-v0.1: 8 experts of width 14336, 2 per token.
    SynthShape {
        name: "mixtral-8x7b",
        arch: Arch::Llama,
        vocab_size: Some(32000),
        hidden_size: 4096,
        intermediate_size: 14336,
        n_layers: 32,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        context_length: 32768,
        rope_theta: 1000000.0,
        rms_eps: 1e-5,
        tie_embeddings: false,
        llama3_rope: None,
        moe: Some(SynthMoe {
            n_experts: 8,
            n_used: 2,
            expert_width: 14336,
            renormalize: true,
        }),
    },
    SynthShape {
        name: "smollm2-135m",
        arch: Arch::Llama,
        vocab_size: Some(49152),
        hidden_size: 576,
        intermediate_size: 1536,
        n_layers: 30,
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        context_length: 8192,
        rope_theta: 100000.0,
        rms_eps: 1e-5,
        tie_embeddings: true,
        llama3_rope: None,
        moe: None,
    },
    // Test shapes: seconds to write and run; rows of 256 so that k-quants are exercised.
    SynthShape {
        name: "tiny",
        arch: Arch::Llama,
        vocab_size: None,
        hidden_size: 256,
        intermediate_size: 512,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        context_length: 512,
        rope_theta: 10000.0,
        rms_eps: 1e-5,
        tie_embeddings: false,
        llama3_rope: Some(Llama3Rope {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        }),
        moe: None,
    },
    SynthShape {
        name: "tiny-qwen3",
        arch: Arch::Qwen3,
        vocab_size: None,
        hidden_size: 256,
        intermediate_size: 512,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        context_length: 512,
        rope_theta: 1000000.0,
        rms_eps: 1e-6,
        tie_embeddings: true,
        llama3_rope: None,
        moe: None,
    },
    SynthShape {
        name: "tiny-qwen3-moe",
        arch: Arch::Qwen3Moe,
        vocab_size: None,
        hidden_size: 256,
        intermediate_size: 512,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        context_length: 512,
        rope_theta: 1000000.0,
        rms_eps: 1e-6,
        tie_embeddings: false,
        llama3_rope: None,
        moe: Some(SynthMoe {
            n_experts: 16,
            n_used: 4,
            expert_width: 256,
            renormalize: true,
        }),
    },
    // GPT-OSS's block at the test width: 8 experts of 256, 2 per token.
    SynthShape {
        name: "tiny-gpt-oss",
        arch: Arch::GptOss,
        vocab_size: None,
        hidden_size: 256,
        intermediate_size: 256,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        context_length: 512,
        rope_theta: 150000.0,
        rms_eps: 1e-5,
        tie_embeddings: false,
        llama3_rope: None,
        moe: Some(SynthMoe {
            n_experts: 8,
            n_used: 2,
            expert_width: 256,
            renormalize: true,
        }),
    },
    // Eight experts, as Mixtral: llama.cpp's 8-expert rules apply.
    SynthShape {
        name: "tiny-mixtral",
        arch: Arch::Llama,
        vocab_size: None,
        hidden_size: 256,
        intermediate_size: 256,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        context_length: 512,
        rope_theta: 1000000.0,
        rms_eps: 1e-5,
        tie_embeddings: false,
        llama3_rope: None,
        moe: Some(SynthMoe {
            n_experts: 8,
            n_used: 2,
            expert_width: 256,
            renormalize: true,
        }),
    },
];

impl SynthShape {
    pub fn by_name(name: &str) -> Option<SynthShape> {
        SHAPES
            .iter()
            .find(|s| s.name.eq_ignore_ascii_case(name))
            .copied()
    }

    pub fn names() -> Vec<&'static str> {
        SHAPES.iter().map(|s| s.name).collect()
    }

    /// The shape as a Hugging Face config.json, parsed (and so validated) by the loader's own
    /// [`ModelConfig::from_hf_json`].
    pub fn config(&self, vocab_size: usize) -> Result<ModelConfig> {
        let model_type = match (self.arch, &self.moe) {
            (Arch::Llama, None) => "llama",
            (Arch::Llama, Some(_)) => "mixtral",
            (Arch::Qwen3, None) => "qwen3",
            (Arch::Qwen3Moe, Some(_)) => "qwen3_moe",
            (Arch::GptOss, Some(_)) => "gpt_oss",
            _ => {
                return Err(Error::Msg(format!(
                    "synthetic models of architecture {}{} are not supported",
                    self.arch.name(),
                    if self.moe.is_some() {
                        " with experts"
                    } else {
                        ""
                    }
                )))
            }
        };
        let mut v = json!({
            "model_type": model_type,
            "vocab_size": vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.context_length,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "tie_word_embeddings": self.tie_embeddings,
        });
        if let Some(m) = self.moe {
            v["num_experts_per_tok"] = json!(m.n_used);
            if self.arch == Arch::GptOss {
                // gpt-oss-20b's config.json: the expert width is intermediate_size; biases,
                // sinks, the clamped SwiGLU at 7; even layers a 128-key window; YaRN 32 over
                // the context / 32 (4096 of 131072).
                v["num_local_experts"] = json!(m.n_experts);
                v["intermediate_size"] = json!(m.expert_width);
                v["attention_bias"] = json!(true);
                v["swiglu_limit"] = json!(7.0);
                v["sliding_window"] = json!(128);
                v["layer_types"] = json!((0..self.n_layers)
                    .map(|i| if i % 2 == 0 {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    })
                    .collect::<Vec<_>>());
                v["rope_parameters"] = json!({
                    "rope_type": "yarn",
                    "rope_theta": self.rope_theta,
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": false,
                    "original_max_position_embeddings": self.context_length / 32,
                });
            } else if self.arch == Arch::Qwen3Moe {
                v["num_experts"] = json!(m.n_experts);
                v["moe_intermediate_size"] = json!(m.expert_width);
                v["norm_topk_prob"] = json!(m.renormalize);
            } else {
                // Mixtral: the expert width is intermediate_size.
                v["num_local_experts"] = json!(m.n_experts);
                v["intermediate_size"] = json!(m.expert_width);
            }
        }
        if let Some(r) = self.llama3_rope {
            v["rope_scaling"] = json!({
                "rope_type": "llama3",
                "factor": r.factor,
                "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor,
                "original_max_position_embeddings": r.original_max_position,
            });
        }
        ModelConfig::from_hf_json(&v)
    }
}
