//! Architectures, each written once over [`ModelConfig`]: a decoder block per family. The model
//! around the blocks (embedding, final norm, logits) is shared in `model.rs`.

pub mod gemma3;
pub mod llama;

use hf2q_tensor::op::{Backend, RopeParams};
use hf2q_tensor::Tensor;

use crate::config::{Arch, ModelConfig};
use crate::kv_cache::SeqRef;
use crate::source::WeightSource;
use crate::Result;

/// One decoder layer: updates the residual stream `x (ΣT, D)` of a batch of sequences in place.
pub trait Block: Send + Sync {
    fn forward(&self, be: &dyn Backend, x: &mut Tensor, seqs: &mut [SeqRef<'_>]) -> Result<()>;
}

/// RoPE of layer `i`: local layers of Gemma 3 use their own base and no scaling.
pub fn rope_for_layer(cfg: &ModelConfig, i: usize, freq_factors: Option<Vec<f32>>) -> RopeParams {
    let local = cfg.sliding_layers.get(i).copied().unwrap_or(false);
    let (theta, scale) = match (local, cfg.rope_theta_local) {
        (true, Some(t)) => (t, 1.0),
        _ => (cfg.rope_theta, cfg.rope_linear_factor),
    };
    RopeParams {
        style: cfg.rope_style,
        theta,
        dims: cfg.head_dim,
        freq_factors: if local && cfg.rope_theta_local.is_some() {
            None
        } else {
            freq_factors
        },
        linear_scale: scale,
    }
}

pub fn load_blocks(src: &WeightSource, cfg: &ModelConfig) -> Result<Vec<Box<dyn Block>>> {
    // Llama 3 frequency factors: a tensor in GGUF, computed from config.json otherwise.
    let ff = if src.contains("rope_freqs.weight") {
        Some(src.vector("rope_freqs.weight")?)
    } else {
        cfg.llama3_freq_factors()
    };
    if let Some(f) = &ff {
        if f.len() != cfg.head_dim / 2 {
            return Err(crate::Error::Config(format!(
                "rope_freqs has {} values, {} expected",
                f.len(),
                cfg.head_dim / 2
            )));
        }
    }
    (0..cfg.n_layers)
        .map(|i| -> Result<Box<dyn Block>> {
            let rope = rope_for_layer(cfg, i, ff.clone());
            Ok(match cfg.arch {
                Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => {
                    Box::new(llama::LlamaBlock::load(src, cfg, i, rope)?)
                }
                Arch::Gemma3 => Box::new(gemma3::Gemma3Block::load(src, cfg, i, rope)?),
            })
        })
        .collect()
}
