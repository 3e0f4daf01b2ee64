//! Writing an MLX affine-quantized folder in mlx-lm's layout (as `mlx_lm.convert(quantize=True)`
//! writes it, checked against folders mlx-lm 0.32.2 wrote: `tests/fixtures/mlx/`).
//!
//! - Every 2-D `*.weight` whose row length is a whole number of groups (mlx-lm quantizes each
//!   Linear and Embedding whose last dim divides by the group size) becomes `W.weight` (uint32,
//!   `(R, C * bits / 32)`), `W.scales` and `W.biases` (`(R, C / group)`, in the model dtype);
//!   everything else stays float in the model dtype.
//! - Safetensors shards carry `{"format": "mlx"}` metadata; the index has `total_size` and
//!   `total_parameters` (the float model's parameter count).
//! - config.json gets `quantization` and `quantization_config` blocks (`group_size`, `bits`,
//!   `mode: "affine"`), with per-module overrides keyed by module path (`model.layers.0.mlp.up_proj`).
//!
//! Weights are read in HF layout (MLX checkpoints are HF checkpoints).

use std::collections::BTreeMap;
use std::path::Path;

use hf2q_tensor::io::safetensors::StDtype;
use hf2q_tensor::quant::mlx::{quantize_affine, quantize_affine_weighted, AffineParams};
use rayon::prelude::*;
use serde_json::{json, Value};

use super::gguf_out::WriteReport;
use super::hf_out::{
    default_dtype, encode_floats, output_config, write_tokenizer_files, ShardWriter,
};
use super::source::{Layout, SourceModel};
use super::{finish_dir, json_text, start_dir, write_text, Progress};
use crate::quantize::imatrix::Imatrix;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// mlx-lm's default largest shard (`max_file_size_gb=5`).
pub const MLX_SHARD_BYTES: usize = 5 << 30;

#[derive(Clone, Debug)]
pub struct MlxOptions {
    pub params: AffineParams,
    /// Per-module recipe by module path (`model.layers.3.mlp.down_proj`): `Some` quantizes with
    /// those parameters, `None` keeps the module float.
    pub overrides: BTreeMap<String, Option<AffineParams>>,
    /// Dtype of scales, biases and float tensors; `None`: the source's float dtype, F16 for
    /// quantized sources.
    pub dtype: Option<StDtype>,
}

fn quant_block(p: AffineParams) -> Value {
    json!({ "group_size": p.group_size, "bits": p.bits, "mode": "affine" })
}

/// Quantizes `x` (`rows` x `cols`, HF layout) -> (packed bytes, scales, biases).
pub fn quantize_matrix(
    p: AffineParams,
    x: &[f32],
    cols: usize,
) -> Result<(Vec<u8>, Vec<f32>, Vec<f32>)> {
    quantize_matrix_weighted(p, x, cols, None)
}

/// [`quantize_matrix`] with optional importance weights, one per column.
pub fn quantize_matrix_weighted(
    p: AffineParams,
    x: &[f32],
    cols: usize,
    weights: Option<&[f32]>,
) -> Result<(Vec<u8>, Vec<f32>, Vec<f32>)> {
    let rows = x.len() / cols;
    let pb = cols * p.bits as usize / 8;
    let g = cols / p.group_size;
    let mut packed = vec![0u8; rows * pb];
    let mut scales = vec![0f32; rows * g];
    let mut biases = vec![0f32; rows * g];
    packed
        .par_chunks_mut(pb)
        .zip(scales.par_chunks_mut(g))
        .zip(biases.par_chunks_mut(g))
        .zip(x.par_chunks(cols))
        .try_for_each(|(((pk, s), b), row)| match weights {
            Some(w) => quantize_affine_weighted(p, row, w, pk, s, b),
            None => quantize_affine(p, row, pk, s, b),
        })?;
    Ok((packed, scales, biases))
}

/// Writes `src` as an MLX affine folder at `out` (which must not exist, or be empty).
pub fn write_mlx(
    src: &SourceModel,
    out: &Path,
    opts: &MlxOptions,
    progress: &dyn Progress,
) -> Result<WriteReport> {
    write_mlx_weighted(src, out, opts, None, progress)
}

/// [`write_mlx`] with an importance matrix: a weight whose entry (by GGUF name) has one value
/// per column is quantized with those importance weights; the layout is the same.
pub fn write_mlx_weighted(
    src: &SourceModel,
    out: &Path,
    opts: &MlxOptions,
    imatrix: Option<&Imatrix>,
    progress: &dyn Progress,
) -> Result<WriteReport> {
    opts.params.validate()?;
    if let Some(t) = src.tensors.iter().find(|t| t.shape.len() == 3) {
        return Err(Error::Msg(format!(
            "{}: MLX output of routed experts (mlx-lm's switch_mlp) is not supported yet; \
             convert to GGUF or a Hugging Face folder instead",
            t.hf
        )));
    }
    let dtype = opts.dtype.unwrap_or_else(|| default_dtype(src));
    let tmp = start_dir(out)?;
    let result = (|| -> Result<WriteReport> {
        let tok = match src.gguf_file() {
            Some(f) => Some(Tokenizer::from_gguf(f)?),
            None => None,
        };
        let mut config = output_config(src, tok.as_ref(), dtype)?;
        let mut shards = ShardWriter::new(
            &tmp,
            MLX_SHARD_BYTES,
            BTreeMap::from([("format".to_string(), "mlx".to_string())]),
        );
        let mut report = WriteReport::default();
        let mut qblock = match quant_block(opts.params) {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        let mut order: Vec<usize> = (0..src.tensors.len()).collect();
        order.sort_by(|&a, &b| src.tensors[a].hf.cmp(&src.tensors[b].hf));
        progress.start(order.len());
        for (k, i) in order.into_iter().enumerate() {
            let t = &src.tensors[i];
            if t.hf == super::source::ROPE_FREQS
                || t.hf == super::source::ROPE_FACTORS_SHORT
                || t.hf == super::source::ROPE_FACTORS_LONG
            {
                continue;
            }
            let x = src.read_f32(t, Layout::Hf)?;
            shards.total_parameters += t.numel() as u64;
            let stem = t.hf.strip_suffix(".weight");
            let recipe = match (stem, t.shape.len()) {
                (Some(s), 2) => match opts.overrides.get(s) {
                    Some(o) => *o,
                    None => Some(opts.params),
                },
                _ => None,
            };
            let recipe = recipe.filter(|p| t.cols().is_multiple_of(p.group_size));
            match (recipe, stem) {
                (Some(p), Some(stem)) => {
                    let weights = imatrix
                        .and_then(|m| m.get(&t.gguf))
                        .filter(|w| w.len() == t.cols());
                    let (packed, scales, biases) =
                        quantize_matrix_weighted(p, &x, t.cols(), weights)?;
                    let (r, c) = (t.rows(), t.cols());
                    let nbytes = packed.len();
                    shards.add(
                        t.hf.clone(),
                        StDtype::U32,
                        vec![r, c * p.bits as usize / 32],
                        packed,
                    )?;
                    shards.add(
                        format!("{stem}.scales"),
                        dtype,
                        vec![r, c / p.group_size],
                        encode_floats(&scales, dtype)?,
                    )?;
                    shards.add(
                        format!("{stem}.biases"),
                        dtype,
                        vec![r, c / p.group_size],
                        encode_floats(&biases, dtype)?,
                    )?;
                    if p != opts.params {
                        qblock.insert(stem.to_string(), quant_block(p));
                    }
                    let name = format!("mlx{}g{}", p.bits, p.group_size);
                    let bytes = (nbytes + 2 * scales.len() * dtype.size()) as u64;
                    report.tensors.push((
                        t.hf.clone(),
                        t.stored.name(),
                        name.clone(),
                        t.numel() as u64,
                        bytes,
                    ));
                    progress.tensor(k + 1, &t.hf, &t.stored.name(), &name);
                }
                _ => {
                    let bytes = encode_floats(&x, dtype)?;
                    report.tensors.push((
                        t.hf.clone(),
                        t.stored.name(),
                        dtype.name().to_string(),
                        t.numel() as u64,
                        bytes.len() as u64,
                    ));
                    shards.add(t.hf.clone(), dtype, t.shape.clone(), bytes)?;
                    progress.tensor(k + 1, &t.hf, &t.stored.name(), dtype.name());
                }
            }
        }
        progress.finish();
        shards.finish(true)?;
        let obj = config
            .as_object_mut()
            .ok_or_else(|| Error::Msg("config.json is not an object".into()))?;
        obj.insert("quantization".into(), Value::Object(qblock.clone()));
        obj.insert("quantization_config".into(), Value::Object(qblock));
        write_text(&tmp.join("config.json"), &json_text(&config))?;
        write_tokenizer_files(src, &tmp, progress)?;
        Ok(report)
    })();
    match result {
        Ok(mut r) => {
            finish_dir(&tmp, out)?;
            r.bytes_written = super::hf_out::dir_size(out);
            Ok(r)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}
