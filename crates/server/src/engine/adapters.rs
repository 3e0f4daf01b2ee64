//! The names of the served LoRA adapters and their reference counts: which adapter a request's
//! `model` names, which slot of the engine's [`hf2q_models::adapter_set::AdapterSet`] holds it,
//! and when an unloaded adapter's slot may be freed.
//!
//! A request holds an [`AdapterRef`] (an `Arc`) from the moment its model name is resolved until
//! its sequence leaves the engine. Unloading removes the name at once (new requests get 404)
//! and moves the entry to `retiring`; the engine frees the slot once nothing else holds the
//! entry, so running requests finish with the adapter they started with, and a slot is never
//! reused while a request still points at it.
//!
//! Not here: reading adapter files (`hf2q_models::adapter`), the factors themselves (the engine
//! thread's set), the HTTP routes (`routes/adapters.rs`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// One loaded adapter.
#[derive(Debug)]
pub struct AdapterInfo {
    pub name: String,
    /// The folder it was read from.
    pub path: PathBuf,
    /// Its slot in the engine's adapter set.
    pub slot: usize,
    /// Unique for the life of the server (a name loaded again gets a new one): what the prefix
    /// cache keys on.
    pub uid: u64,
    pub rank: usize,
    pub alpha: f32,
    pub targets: Vec<String>,
    /// Unix time it was loaded.
    pub created: u64,
}

pub type AdapterRef = Arc<AdapterInfo>;

/// Loaded adapters by name, and unloaded ones still in use.
#[derive(Default)]
pub struct Registry {
    by_name: BTreeMap<String, AdapterRef>,
    retiring: Vec<AdapterRef>,
    next_uid: u64,
}

/// Whether `name` may name an adapter: 1 to 64 of `A-Z a-z 0-9 . _ -`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

impl Registry {
    pub fn get(&self, name: &str) -> Option<AdapterRef> {
        self.by_name.get(name).cloned()
    }
    /// Loaded adapters in name order.
    pub fn list(&self) -> Vec<AdapterRef> {
        self.by_name.values().cloned().collect()
    }
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }
    pub fn next_uid(&mut self) -> u64 {
        self.next_uid += 1;
        self.next_uid
    }
    pub fn insert(&mut self, a: AdapterRef) {
        self.by_name.insert(a.name.clone(), a);
    }
    /// Removes `name` from the names; returns how many requests still hold it.
    pub fn unload(&mut self, name: &str) -> Option<usize> {
        let a = self.by_name.remove(name)?;
        // Holders other than this entry.
        let users = Arc::strong_count(&a) - 1;
        self.retiring.push(a);
        Some(users)
    }
    /// Unloaded adapters that nothing holds any more (their slots can be freed).
    pub fn take_released(&mut self) -> Vec<AdapterRef> {
        let (free, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retiring)
            .into_iter()
            .partition(|a| Arc::strong_count(a) == 1);
        self.retiring = keep;
        free
    }
    /// Unloaded adapters still finishing requests.
    pub fn retiring(&self) -> usize {
        self.retiring.len()
    }
}
