//! The one error type of the training crate: every failure names what was wrong (a data file
//! and line, a setting, a checkpoint).

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] hf2q_models::Error),
    #[error(transparent)]
    Tensor(#[from] hf2q_tensor::Error),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// A record of a data file that cannot be used, with its 1-based line (JSONL) or index.
    #[error("{path}:{line}: {msg}")]
    Data {
        path: std::path::PathBuf,
        line: usize,
        msg: String,
    },
    /// An impossible setting.
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Msg(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
