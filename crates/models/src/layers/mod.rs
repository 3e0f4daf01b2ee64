//! Building blocks shared by every architecture.
pub mod attention;
pub mod linear;
pub mod lora;
pub mod mlp;
pub mod moe;
pub mod served;
