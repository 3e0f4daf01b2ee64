//! Typed errors of the Hub client, each worded with what to do about it (accept a licence, log
//! in, check a name, go online), so the CLI prints them as they are.

use std::path::PathBuf;

/// Where a failed request was going: the repository, the revision and (for a file) its path.
#[derive(Clone, Debug, Default)]
pub struct Target {
    pub repo: String,
    /// The repository's path in page URLs (`ORG/NAME`, `datasets/ORG/NAME`).
    pub url_path: String,
    pub revision: String,
    pub path: Option<String>,
}

impl Target {
    pub fn new(repo: &crate::repo::RepoId, revision: &str, path: Option<&str>) -> Target {
        Target {
            repo: repo.to_string(),
            url_path: repo.url_path(),
            revision: revision.to_string(),
            path: path.map(str::to_string),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "'{name}' is not a repository name: {why} (expected ORG/NAME, ORG/NAME:QUANT or \
         ORG/NAME@REVISION, e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M)"
    )]
    InvalidRepo { name: String, why: String },

    #[error(
        "{repo} is gated: accept its licence at {page} and log in with a token of that account \
         (--hf-token, HF_TOKEN, or the token file that `hf auth login` writes)"
    )]
    GatedNeedsToken { repo: String, page: String },

    #[error(
        "{repo} is gated and the token given has no access to it (HTTP 403): accept the licence \
         at {page} with the account the token belongs to, or use a token of an account that has"
    )]
    GatedNoAccess { repo: String, page: String },

    #[error(
        "repository {repo} not found on {endpoint}: check the name (ORG/NAME as on its page){}",
        if *had_token { "" } else { "; if it is private, log in with a token (--hf-token or HF_TOKEN)" }
    )]
    RepoNotFound {
        repo: String,
        endpoint: String,
        had_token: bool,
    },

    #[error("the token was refused by {endpoint} (HTTP 401): check --hf-token, HF_TOKEN or the token file")]
    BadToken { endpoint: String },

    #[error(
        "revision '{revision}' not found in {repo}: check the branch, tag or commit name \
         (--revision REV; the default is main)"
    )]
    RevisionNotFound { repo: String, revision: String },

    #[error("file '{path}' not found in {repo} at revision {revision}: check the file name or --include")]
    FileNotFound {
        repo: String,
        revision: String,
        path: String,
    },

    #[error(
        "{repo} has no GGUF file of type {quant}{}; pick one with {repo}:TYPE",
        if available.is_empty() { String::new() } else { format!(" (it has: {})", available.join(", ")) }
    )]
    QuantNotFound {
        repo: String,
        quant: String,
        available: Vec<String>,
    },

    #[error(
        "{repo} has several GGUF files and none of the default type Q4_K_M (it has: {}); pick \
         one with {repo}:TYPE",
        available.join(", ")
    )]
    QuantAmbiguous {
        repo: String,
        available: Vec<String>,
    },

    #[error(
        "{repo} has no files hf2q can load (no .gguf, no .safetensors with config.json){}; pick \
         files with --include GLOB",
        if *filtered { " among the files the globs left" } else { "" }
    )]
    NothingToLoad { repo: String, filtered: bool },

    #[error(
        "dataset {repo} has no data files (.jsonl, .json, .csv, .parquet){}{}",
        split.as_ref().map(|s| format!(" for split '{s}'")).unwrap_or_default(),
        if available.is_empty() { String::new() } else { format!(" (it has: {}); pick a split with {repo}:SPLIT or files with --include", available.join(", ")) }
    )]
    NoDataFiles {
        repo: String,
        split: Option<String>,
        available: Vec<String>,
    },

    #[error("{repo}:{quant} asks for a GGUF file, but {repo} has no .gguf files")]
    QuantOnNonGguf { repo: String, quant: String },

    #[error("offline (--offline or HF_HUB_OFFLINE=1): {what}")]
    Offline { what: String },

    #[error("{path}: {got} bytes received where the Hub announced {expected}: refused, nothing kept in the cache")]
    SizeMismatch {
        path: String,
        expected: u64,
        got: u64,
    },

    #[error("{path}: sha256 {got} where the Hub announced {expected}: refused (corrupt download), nothing kept in the cache")]
    HashMismatch {
        path: String,
        expected: String,
        got: String,
    },

    #[error("{path}: the download kept failing after {tries} tries: {last} (run the pull again: it resumes)")]
    Incomplete {
        path: String,
        tries: usize,
        last: String,
    },

    #[error(
        "pushing to {endpoint} needs a token with write access (HTTP 401): pass --hf-token, set \
         HF_TOKEN, or log in with `hf auth login`"
    )]
    PushNeedsToken { endpoint: String },

    #[error(
        "the token may not write to {repo} (HTTP 403{}): use a token with write access of an \
         account that may write to that namespace",
        if message.is_empty() { String::new() } else { format!(": {message}") }
    )]
    NoWriteAccess { repo: String, message: String },

    #[error("{path}: the Hub refused its upload: {message}")]
    UploadRefused { path: String, message: String },

    #[error("{}: nothing to push ({why})", path.display())]
    NothingToPush { path: PathBuf, why: String },

    #[error("HTTP {status} from {url}{}", if message.is_empty() { String::new() } else { format!(": {message}") })]
    Http {
        status: u16,
        url: String,
        message: String,
    },

    #[error(
        "cannot reach {url}: {message} (check the network, or HF_ENDPOINT for a mirror; \
         --offline or HF_HUB_OFFLINE=1 uses the cache only)"
    )]
    Network { url: String, message: String },

    #[error("unexpected answer from {url}: {why}")]
    Protocol { url: String, why: String },

    #[error("bad glob '{glob}': {why}")]
    Glob { glob: String, why: String },

    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = HubError> = std::result::Result<T, E>;

impl HubError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        HubError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Adds the path to an `io::Result`'s error.
pub(crate) trait IoContext<T> {
    fn at(self, path: &std::path::Path) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T> {
        self.map_err(|e| HubError::io(path, e))
    }
}
