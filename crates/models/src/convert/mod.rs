//! Moving a model between GGUF, Hugging Face safetensors and MLX affine folders.
//!
//! - [`source`]: any input opened as a list of tensors under both naming conventions, read as f32
//!   in either tensor layout (llama.cpp's permuted Llama q/k rows, Gemma's `1 + w` norms).
//! - [`gguf_out`]: GGUF writing (llama-quantize's tensor order and metadata handling).
//! - [`gguf_meta`]: GGUF metadata built from a Hugging Face config.json + tokenizer files.
//! - [`hf_out`]: Hugging Face folder (config.json, sharded safetensors + index, tokenizer files);
//!   [`hf_gpt_oss`]: GPT-OSS's MXFP4 experts in that folder.
//! - [`mlx_out`]: mlx-lm's affine-quantized folder layout.
//!
//! Every writer streams: one tensor (or one safetensors shard) in memory at a time, and output
//! appears under its final name only once complete. Quantization choices (presets, per-tensor
//! rules, importance matrices) live in `crate::quantize`; this module only moves bytes.

pub mod gguf_meta;
pub mod gguf_out;
pub mod hf_gpt_oss;
pub mod hf_out;
pub mod mlx_out;
pub mod source;
mod stacked;

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Progress and warnings of a long write; the CLI draws a bar, tests ignore it.
pub trait Progress: Sync {
    fn start(&self, _total: usize) {}
    /// `done` of `total` tensors finished; the last one was `name`, `from` -> `to`.
    fn tensor(&self, _done: usize, _name: &str, _from: &str, _to: &str) {}
    fn finish(&self) {}
    fn warn(&self, _msg: &str) {}
}

/// A [`Progress`] that reports nothing.
pub struct NoProgress;
impl Progress for NoProgress {}

/// Creates the output folder as `OUT.partial-<pid>` beside `out`; [`finish_dir`] renames it into
/// place. Refuses an `out` that exists and is not an empty folder.
pub fn start_dir(out: &Path) -> Result<PathBuf> {
    if out.exists() {
        let empty = out.is_dir()
            && std::fs::read_dir(out)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
        if !empty {
            return Err(Error::Msg(format!(
                "{}: already exists (choose a new output folder)",
                out.display()
            )));
        }
    }
    let name = out
        .file_name()
        .ok_or_else(|| Error::Msg(format!("{}: not a folder path", out.display())))?;
    let tmp = out.with_file_name(format!(
        ".{}.partial-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    hf2q_tensor::io::remove_stale_temps(out);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::Io {
            path: tmp.clone(),
            source: e,
        })?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::Io {
        path: tmp.clone(),
        source: e,
    })?;
    Ok(tmp)
}

/// Moves a finished temporary folder onto `out`.
pub fn finish_dir(tmp: &Path, out: &Path) -> Result<()> {
    if out.is_dir() {
        std::fs::remove_dir(out).map_err(|e| Error::Io {
            path: out.to_path_buf(),
            source: e,
        })?;
    }
    std::fs::rename(tmp, out).map_err(|e| Error::Io {
        path: out.to_path_buf(),
        source: e,
    })
}

/// Writes a small text file atomically (temporary name, then rename).
pub fn write_text(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, text).map_err(|e| Error::Io {
        path: tmp.clone(),
        source: e,
    })?;
    std::fs::rename(&tmp, path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// Pretty JSON with a trailing newline, as Hugging Face writes its files.
pub fn json_text(v: &serde_json::Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("JSON values serialize");
    s.push('\n');
    s
}

/// Where `hf2q convert` writes to.
#[derive(Clone, Debug)]
pub enum ConvertTarget {
    /// GGUF; with a recipe the tensors are quantized as `hf2q quantize` would, without one every
    /// tensor keeps its type (MLX affine weights become F16; vectors of a float source F32).
    Gguf(Option<crate::quantize::presets::GgufRecipe>),
    Hf(hf_out::HfOptions),
    Mlx(mlx_out::MlxOptions),
}

/// Converts `src` to `target` at `out`.
pub fn convert(
    src: &source::SourceModel,
    out: &Path,
    target: &ConvertTarget,
    progress: &dyn Progress,
) -> Result<gguf_out::WriteReport> {
    use crate::quantize::{self, rules::Overrides, QuantizeOptions};
    match target {
        ConvertTarget::Gguf(Some(recipe)) => {
            let opts = QuantizeOptions {
                target: quantize::presets::QuantTarget::Gguf(*recipe),
                overrides: Overrides::default(),
                imatrix: None,
            };
            Ok(quantize::quantize(src, out, &opts, progress)?.written)
        }
        ConvertTarget::Gguf(None) => {
            let plan = quantize::plan_gguf_keep(src);
            let file_type = quantize::file_type_of(src, &plan);
            let meta = match src.gguf_file() {
                Some(f) => gguf_out::metadata_from_gguf(f, file_type),
                None => gguf_meta::metadata_from_hf(src, file_type)?,
            };
            gguf_out::write_gguf(src, out, meta, &plan, None, progress)
        }
        ConvertTarget::Hf(o) => hf_out::write_hf(src, out, o, progress),
        ConvertTarget::Mlx(o) => mlx_out::write_mlx(src, out, o, progress),
    }
}
