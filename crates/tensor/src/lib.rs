//! hf2q-tensor: the shared types of hf2q, which every backend implements and every model uses.
//! It depends on no backend: the CPU backend is `hf2q-cpu`, the CUDA backend `hf2q-cuda`.
//!
//! - [`dtype`]: ggml's element/block types, numbered as ggml numbers them.
//! - [`quant`]: scalar reference dequantization for every supported block format (ggml's byte
//!   layouts) and MLX affine.
//! - [`io`]: GGUF and safetensors readers and writers; every count and offset checked.
//! - [`weight`]: a 2-D weight kept in its stored form (quantized blocks, MLX affine, dense).
//! - [`tensor`] + [`op`]: activations and the closed op set (the [`op::Backend`] trait).
//! - [`kv`]: the per-layer KV cache a backend reads and writes (host planes or a device cache).
//! - [`paged`]: the paged KV cache's block pool, block tables and layout (no storage).
//! - [`paged_prefix`]: the paged KV cache's prefix cache (full blocks found again by their tokens).
//! - [`lora_rows`]: several LoRA adapters' low-rank terms over one batch, each on its rows.
//! - [`moe`]: mixture-of-experts routing and expert products over the op set.
//! - [`train_op`]: the training op set (backward of every op, attention with its log-sum-exp,
//!   the fused output layer and loss, AdamW) and the shape checks every backend shares.

pub mod dtype;
pub mod error;
pub mod io;
pub mod kv;
pub mod kv_affine;
pub mod kv_blocks;
pub mod kv_centre;
pub mod lora_rows;
pub mod moe;
pub mod op;
pub mod paged;
pub mod paged_prefix;
pub mod quant;
pub mod storage;
pub mod tensor;
pub mod train_op;
pub mod weight;

pub use dtype::GgmlType;
pub use error::{Error, Result};
pub use storage::Bytes;
pub use tensor::Tensor;
pub use weight::{QTensor, WeightData};
