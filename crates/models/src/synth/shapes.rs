//! The model shapes `hf2q synth` knows: the dimensions, vocabulary size and RoPE settings of the
//! upstream config.json of each model, turned into a [`ModelConfig`] by the loader's own parser.

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

/// A model's dimensions and the architecture settings that the GGUF metadata carries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthShape {
    pub name: &'static str,
    /// `Arch::Llama` or `Arch::Qwen3`.
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
        if !matches!(self.arch, Arch::Llama | Arch::Qwen3) {
            return Err(Error::Msg(format!(
                "synthetic models of architecture {} are not supported",
                self.arch.name()
            )));
        }
        let mut v = json!({
            "model_type": self.arch.name(),
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
