//! hf2q-models: architectures written once over one config, loading from GGUF / Hugging Face /
//! MLX, tokenizers, chat templates, sampling and generation.

pub mod adapter;
pub mod adapter_set;
pub mod arch;
pub mod chat_template;
pub mod config;
pub mod constraint;
pub mod convert;
pub mod error;
pub mod generate;
pub mod generation;
pub mod kv_cache;
pub mod kv_config;
pub mod layers;
pub mod model;
pub mod names;
pub mod perplexity;
pub mod quantize;
pub mod sampler;
pub mod source;
pub mod stop;
pub mod synth;
pub mod tokenizer;
pub mod tool_calls;
pub mod train_pass;

pub use error::{Error, Result};
pub use model::{
    BatchItem, ExpertsInfo, Model, ModelInfo, PagedItem, PagedKvCache, Picked, RowPick, Session,
};
