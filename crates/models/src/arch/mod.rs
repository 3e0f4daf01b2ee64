//! Architectures, each written once over [`ModelConfig`]: a decoder block per family. The model
//! around the blocks (embedding, final norm, logits) is shared in `model.rs`.

pub mod gemma3;
pub mod gemma4;
pub mod llama;
pub mod olmo2;

use hf2q_tensor::op::RopeParams;
use hf2q_tensor::Tensor;

use crate::config::{Arch, ModelConfig};
use crate::kv_cache::SeqRef;
use crate::layers::attention::Attention;
use crate::layers::linear::Linear;
use crate::layers::lora::{LoraGrads, TrainCtx};
use crate::layers::mlp::Mlp;
use crate::layers::served::Fwd;
use crate::source::WeightSource;
use crate::Result;

/// What a block's training forward keeps for its backward (each family its own struct).
pub type Saved = Box<dyn std::any::Any + Send>;

/// One decoder layer: updates the residual stream `x (ΣT, D)` of a batch of sequences in place
/// (`cx`: the backend, and the batch's served adapters, which only `Linear` reads);
/// and the same as a training forward (`x (N, D)` of a packed batch, returning the new
/// residual stream and what the backward needs) with its backward.
pub trait Block: Send + Sync {
    fn forward(&self, cx: &Fwd, x: &mut Tensor, seqs: &mut [SeqRef<'_>]) -> Result<()>;
    fn forward_train(&self, cx: &TrainCtx, x: &Tensor) -> Result<(Tensor, Saved)>;
    /// From `dy (N, D)`, the gradient of the block's input `x`; adapters' gradients go into
    /// `grads`. `saved` is what `forward_train(x)` returned.
    fn backward(
        &self,
        cx: &TrainCtx,
        x: &Tensor,
        saved: Saved,
        dy: Tensor,
        grads: &mut LoraGrads,
    ) -> Result<Tensor>;
    /// Every product of the block by its module path under the layer (`self_attn.q_proj`,
    /// `mlp.down_proj`, ...), in the checkpoint's order.
    fn linears(&self) -> Vec<(&'static str, &Linear)>;
    fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)>;

    /// Whether [`Block::forward_with`] needs the batch's tokens and their embeddings (Gemma 4's
    /// per-layer embeddings).
    fn wants_inputs(&self) -> bool {
        false
    }
    /// [`Block::forward`], given the batch's tokens and embeddings when
    /// [`Block::wants_inputs`].
    fn forward_with(
        &self,
        cx: &Fwd,
        x: &mut Tensor,
        seqs: &mut [SeqRef<'_>],
        _inputs: Option<&BlockInputs<'_>>,
    ) -> Result<()> {
        self.forward(cx, x, seqs)
    }
    /// The RoPE of the keys this block writes to its KV cache (what a cache's centred keys
    /// follow: `hf2q_tensor::kv::KeyRope`); `None` when it rotates none.
    fn rope(&self) -> Option<&RopeParams> {
        None
    }
    /// The earlier layer whose KV cache this block attends over instead of its own (Gemma 4's
    /// KV-shared layers, which write none).
    fn kv_source(&self) -> Option<usize> {
        None
    }
    /// The block's parts when it is a plain pre-norm Llama layer (attention, then a dense gated
    /// MLP, residual sums unscaled): what the decode megakernel may run (`crate::model::mega`).
    fn dense_llama(&self) -> Option<DenseLlama<'_>> {
        None
    }
}

/// A plain pre-norm Llama layer's parts ([`Block::dense_llama`]): `x += attn(rmsnorm(x));
/// x += mlp(rmsnorm(x))`, both norms of `eps` and weight offset 0.
pub struct DenseLlama<'a> {
    /// (D)
    pub attn_norm: &'a [f32],
    pub attn: &'a Attention,
    /// (D)
    pub mlp_norm: &'a [f32],
    pub mlp: &'a Mlp,
    pub eps: f32,
}

/// What a block may read besides the residual stream: the batch's token ids `(ΣT)` and their
/// scaled embeddings `(ΣT, D)` (the stream entering the first block).
pub struct BlockInputs<'a> {
    pub ids: &'a [u32],
    pub embed: &'a Tensor,
}

/// The module paths of [`Attention`] and [`Mlp`] products, in the order of
/// [`Block::linears`].
pub const LINEAR_PATHS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// [`Block::linears`] of a block made of one [`Attention`] and one [`Mlp`].
pub fn attention_mlp_linears<'a>(a: &'a Attention, m: &'a Mlp) -> Vec<(&'static str, &'a Linear)> {
    let l = [&a.q, &a.k, &a.v, &a.o, &m.gate, &m.up, &m.down];
    LINEAR_PATHS.into_iter().zip(l).collect()
}

/// [`Block::linears_mut`] of a block made of one [`Attention`] and one [`Mlp`].
pub fn attention_mlp_linears_mut<'a>(
    a: &'a mut Attention,
    m: &'a mut Mlp,
) -> Vec<(&'static str, &'a mut Linear)> {
    let l = [
        &mut a.q,
        &mut a.k,
        &mut a.v,
        &mut a.o,
        &mut m.gate,
        &mut m.up,
        &mut m.down,
    ];
    LINEAR_PATHS.into_iter().zip(l).collect()
}

/// [`Block::linears`] of a block whose MLP has no products of its own (routed experts).
pub fn attention_linears(a: &Attention) -> Vec<(&'static str, &Linear)> {
    LINEAR_PATHS[..4]
        .iter()
        .copied()
        .zip([&a.q, &a.k, &a.v, &a.o])
        .collect()
}

/// [`Block::linears_mut`] of a block whose MLP has no products of its own.
pub fn attention_linears_mut(a: &mut Attention) -> Vec<(&'static str, &mut Linear)> {
    LINEAR_PATHS[..4]
        .iter()
        .copied()
        .zip([&mut a.q, &mut a.k, &mut a.v, &mut a.o])
        .collect()
}

/// A block's saved state back as its own type.
pub(crate) fn downcast<T: 'static>(saved: Saved) -> Result<Box<T>> {
    saved
        .downcast::<T>()
        .map_err(|_| crate::Error::Msg("a block was given another block's saved state".into()))
}

/// RoPE of layer `i`: local layers of Gemma 3 use their own base and no scaling; SmolLM3's
/// no-RoPE layers rotate nothing; partial rotary (Phi-4-mini) rotates the first `rope_dims`.
pub fn rope_for_layer(cfg: &ModelConfig, i: usize, freq_factors: Option<Vec<f32>>) -> RopeParams {
    let local = cfg.sliding_layers.get(i).copied().unwrap_or(false);
    let (theta, scale) = match (local, cfg.rope_theta_local) {
        (true, Some(t)) => (t, 1.0),
        _ => (cfg.rope_theta, cfg.rope_linear_factor),
    };
    RopeParams {
        style: cfg.rope_style,
        theta,
        dims: if cfg.nope_layers.get(i).copied().unwrap_or(false) {
            0
        } else {
            cfg.rope_dims
        },
        freq_factors: if local && cfg.rope_theta_local.is_some() {
            None
        } else {
            freq_factors
        },
        linear_scale: scale,
    }
}

pub fn load_blocks(src: &WeightSource, cfg: &ModelConfig) -> Result<Vec<Box<dyn Block>>> {
    // Gemma 4's layers differ in head width and RoPE: its module builds them all.
    if cfg.arch == Arch::Gemma4 {
        return gemma4::load_blocks(src, cfg);
    }
    // Llama 3 frequency factors: a tensor in GGUF, computed from config.json otherwise;
    // LongRoPE's short factors (sequences up to its original context: transformers switches to
    // the long factors for a longer sequence, which a cache of the short ones cannot follow).
    let ff = if src.contains("rope_freqs.weight") {
        Some(src.vector("rope_freqs.weight")?)
    } else if let Some(l) = &cfg.longrope {
        Some(l.short_factor.clone())
    } else if let Some(y) = &cfg.yarn {
        Some(y.freq_factors(cfg.rope_theta as f64, cfg.rope_dims))
    } else {
        cfg.llama3_freq_factors()
    };
    if let Some(f) = &ff {
        if f.len() != cfg.rope_dims / 2 {
            return Err(crate::Error::Config(format!(
                "rope_freqs has {} values, {} expected",
                f.len(),
                cfg.rope_dims / 2
            )));
        }
    }
    (0..cfg.n_layers)
        .map(|i| -> Result<Box<dyn Block>> {
            let rope = rope_for_layer(cfg, i, ff.clone());
            Ok(match cfg.arch {
                Arch::Llama
                | Arch::Qwen2
                | Arch::Qwen3
                | Arch::Qwen3Moe
                | Arch::Phi3
                | Arch::SmolLm3
                | Arch::Granite
                | Arch::MiniCpm
                | Arch::GptOss => Box::new(llama::LlamaBlock::load(src, cfg, i, rope)?),
                Arch::Olmo2 => Box::new(olmo2::Olmo2Block::load(src, cfg, i, rope)?),
                Arch::Gemma3 => Box::new(gemma3::Gemma3Block::load(src, cfg, i, rope)?),
                Arch::Gemma4 => {
                    return Err(crate::Error::Msg(
                        "Gemma 4 blocks load in arch::gemma4".into(),
                    ))
                }
            })
        })
        .collect()
}
