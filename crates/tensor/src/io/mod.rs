//! File formats: GGUF (read + write) and safetensors (read + write, single or sharded).
pub mod gguf;
pub mod safetensors;
