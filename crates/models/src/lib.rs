//! hf2q-models: architectures written once over one config, loading from GGUF / Hugging Face /
//! MLX, tokenizers, chat templates, sampling and generation.

pub mod chat_template;
pub mod error;
pub mod sampler;
pub mod stop;
pub mod tokenizer;

pub use error::{Error, Result};
