//! hf2q-lab: the Lab's jobs. Long work (quantize, convert, imatrix, perplexity, training, pull)
//! runs as child `hf2q` processes in process groups of their own; their state lives in a SQLite
//! table ([`db`]), their output in an append-only NDJSON event log per job with sequence numbers
//! ([`events`]), so a crash of a job or of the server loses nothing saved.
//!
//! Layout: [`hub_token`] keeps the Hub token the jobs get (`$HF2Q_HOME/hub_token`, 0600);
//! [`kinds`] maps a job's JSON params to the child's argv (one table per kind, the
//! CLI's flag names); [`paths`] keeps every path inside `$HF2Q_HOME`; [`runner`] queues, leases
//! (one GPU job at a time, a limit of CPU jobs), spawns, cancels and records.
//!
//! Not here: HTTP (the server crate's `/api` routes call [`Lab`]), the environment (the binary
//! passes `$HF2Q_HOME` and its own path in [`LabConfig`]), what a job does (the `hf2q` commands;
//! the `dataset` kind runs `hf2q dataset build`, `dataset_generate` runs `hf2q dataset generate`
//! against the server the Lab runs in, [`Lab::set_api`]).

pub mod db;
pub mod events;
pub mod hub_token;
pub mod kinds;
pub mod paths;
pub mod runner;

pub use db::{Job, State};
pub use events::Event;
pub use kinds::Kind;
pub use runner::{Lab, LabConfig, ServerApi};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the job database: {0}")]
    Db(#[from] rusqlite::Error),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// A job parameter that is unknown, missing or of the wrong kind.
    #[error("{param}: {message}")]
    Param { param: String, message: String },
    /// A path that would leave `$HF2Q_HOME`, or one that cannot be used.
    #[error("{param}: {message}")]
    Path { param: String, message: String },
    #[error("{0}")]
    NotFound(String),
    /// The job is not in a state that allows the request (e.g. deleting a running job).
    #[error("{0}")]
    Conflict(String),
}

impl Error {
    pub fn io(path: &std::path::Path, source: std::io::Error) -> Error {
        Error::Io {
            path: path.display().to_string(),
            source,
        }
    }
    pub fn param(param: &str, message: impl Into<String>) -> Error {
        Error::Param {
            param: param.to_string(),
            message: message.into(),
        }
    }
    pub fn path(param: &str, message: impl Into<String>) -> Error {
        Error::Path {
            param: param.to_string(),
            message: message.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Seconds since the Unix epoch.
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
