//! File formats: GGUF (read + write) and safetensors (read + write, single or sharded); the
//! cleanup of temporary files that killed writers left behind.
pub mod gguf;
pub mod safetensors;
pub mod stale;

pub use stale::remove_stale_temps;
