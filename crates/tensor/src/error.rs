//! The one error type of the tensor crate: every failure names what was wrong.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("i/o error: {0}")]
    IoBare(#[from] std::io::Error),
    /// A file's bytes contradict its own header or the format (truncated, absurd counts, ...).
    #[error("malformed {format} file: {msg}")]
    Malformed { format: &'static str, msg: String },
    #[error("unsupported tensor type {ty} for tensor '{tensor}'")]
    UnsupportedType { ty: String, tensor: String },
    #[error("unknown ggml type id {0}")]
    UnknownTypeId(u32),
    #[error("shape error: {0}")]
    Shape(String),
    #[error("{0}")]
    Msg(String),
    /// An op that cannot run inside a captured GPU graph was asked to while capturing (the
    /// caller runs the step eagerly instead).
    #[error("not capturable: {0}")]
    NotCapturable(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn malformed(format: &'static str, msg: impl Into<String>) -> Self {
        Error::Malformed {
            format,
            msg: msg.into(),
        }
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
