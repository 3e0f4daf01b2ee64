//! hf2q-models: architectures written once over one config, loading from GGUF / Hugging Face /
//! MLX, tokenizers, chat templates, sampling and generation.

pub mod chat_template;
pub mod error;
pub mod generate;
pub mod model;
pub mod config;
pub mod names;
pub mod source;
pub mod kv_cache;
pub mod arch;
pub mod layers;
pub mod sampler;
pub mod stop;
pub mod tokenizer;
pub mod convert;
pub mod perplexity;
pub mod quantize;

pub use error::{Error, Result};
pub use model::{BatchItem, Model, ModelInfo, Session};
