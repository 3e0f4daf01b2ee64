//! The one error type of the models crate.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Tensor(#[from] hf2q_tensor::Error),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    /// A grammar or JSON Schema that constrained decoding cannot use (the message names the
    /// feature), or a failure while constraining.
    #[error("grammar: {0}")]
    Grammar(String),
    #[error("{0}")]
    Msg(String),
    /// A paged KV cache's pool has too few free blocks for a step (nothing ran; free blocks,
    /// e.g. by preempting a sequence, and retry).
    #[error(transparent)]
    KvBlocks(#[from] hf2q_tensor::paged::OutOfBlocks),
}

pub type Result<T> = std::result::Result<T, Error>;
