//! hf2q-train: LoRA fine-tuning on top of `hf2q-models`: the optimizer and schedules
//! ([`optim`]), and (in the modules below) data, batching, the training loop and checkpoints.

pub mod error;
pub mod optim;

pub use error::{Error, Result};
