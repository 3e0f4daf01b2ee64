//! hf2q-train: LoRA fine-tuning on top of `hf2q-models`.
//!
//! - [`data`]: records from JSON/JSONL files (OpenAI messages, ShareGPT, Alpaca,
//!   prompt/completion, text), errors naming file and line;
//! - [`dataset`]: the dataset builder (CSV/JSON/JSONL import, conversion, duplicates, split,
//!   token lengths);
//! - [`render`]: records to token ids and the tokens learned (chat template, assistant-only);
//! - [`batch`]: seeded epochs, packed micro-batches;
//! - [`optim`]: AdamW, clipping, schedules;
//! - [`dpo`]: DPO's loss over preference pairs and its reference policy;
//! - [`trainer`]: the loop (SFT or DPO) (accumulation, evaluation, checkpoints, resume, stop);
//! - [`checkpoint`], [`report`]: what a run writes and says.
//!
//! Not here: the model's forward and backward (`hf2q_models::train_pass`), adapter files
//! (`hf2q_models::adapter`), progress bars and flags (the CLI).

pub mod batch;
pub mod checkpoint;
pub mod data;
pub mod dataset;
pub mod dpo;
pub mod error;
pub mod optim;
pub mod render;
pub mod report;
pub mod trainer;

pub use error::{Error, Result};
