//! hf2q-hub: the Hugging Face Hub client of hf2q. Repository names (`repo`), the cache shared
//! with huggingface_hub and llama.cpp (`cache`), the HTTP API (`api`) and its tree listing (`tree`), resumable checked
//! downloads (`download`), which files a model needs (`select`) or a dataset split (`data_select`), errors that say what to do
//! (`error`), and the pull that ties them together (`pull`). Pushing: the write API
//! (`write_api`) and its multipart LFS transfer (`lfs_multipart`), the push of a folder or file in one commit (`push`), the model card written
//! when a folder has none (`card`), base64 for the commit API (`b64`). With the `mock` feature, a Hub on
//! loopback with fault injection for tests (`mock`).
//!
//! Library code reads no environment variables: the binary fills [`HubConfig`].

pub mod api;
pub mod b64;
pub mod cache;
pub mod card;
pub mod data_select;
pub mod download;
pub mod error;
pub mod lfs_multipart;
#[cfg(feature = "mock")]
pub mod mock;
pub mod pull;
pub mod push;
pub mod repo;
pub mod select;
pub mod tree;
pub mod write_api;

pub use cache::{Cache, CachedRepo, CachedRevision, Removed};
pub use error::{HubError, Result};
pub use pull::{find_cached, pull, pull_dataset, HubConfig, PullRequest, Pulled, PARQUET_REVISION};
pub use push::{push, PushRequest, Pushed};
pub use repo::{RepoId, RepoKind, RepoRef};
pub use select::{Filter, Selection};
