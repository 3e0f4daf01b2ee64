//! Writing a GGUF file from a [`SourceModel`]: one tensor in memory at a time, quantized on all
//! cores, written through a temporary name and renamed (an interrupted write leaves no file that
//! looks complete).
//!
//! Layout and metadata follow llama-quantize: tensors in its order (layer, then name; see
//! `quantize::rules::gguf_order`), metadata copied from a GGUF source with `split.*` removed and
//! `general.quantization_version` + `general.file_type` set last. So quantizing a GGUF with the
//! same rules reproduces llama-quantize's file byte for byte.

use std::path::Path;

use hf2q_tensor::io::gguf::{GgufFile, GgufValue, GgufWriter};
use hf2q_tensor::quant::{self, kquant_quantize::quantize_weighted};
use hf2q_tensor::GgmlType;
use rayon::prelude::*;

use super::source::{Layout, SourceModel, Stored};
use super::Progress;
use crate::quantize::imatrix::Imatrix;
use crate::{Error, Result};

/// ggml's `GGML_QNT_VERSION`.
pub const QUANTIZATION_VERSION: u32 = 2;

/// One output tensor: which source tensor, and the type to store it in.
#[derive(Clone, Debug)]
pub struct GgufPlanEntry {
    /// Index into `SourceModel::tensors`.
    pub src: usize,
    pub to: GgmlType,
}

/// What was written, per tensor and in total.
#[derive(Clone, Debug, Default)]
pub struct WriteReport {
    /// (name, stored type before, type written, elements, bytes written)
    pub tensors: Vec<(String, String, String, u64, u64)>,
    pub bytes_written: u64,
}

impl WriteReport {
    pub fn n_elements(&self) -> u64 {
        self.tensors.iter().map(|t| t.3).sum()
    }
    /// Tensor bytes over tensor elements (what llama.cpp prints as BPW).
    pub fn bits_per_weight(&self) -> f64 {
        let bytes: u64 = self.tensors.iter().map(|t| t.4).sum();
        bytes as f64 * 8.0 / self.n_elements().max(1) as f64
    }
}

/// Metadata of a GGUF source as llama-quantize writes it: everything in order, minus the split
/// keys, with `general.quantization_version` and `general.file_type` moved to the end.
pub fn metadata_from_gguf(file: &GgufFile, file_type: u32) -> Vec<(String, GgufValue)> {
    let mut m: Vec<(String, GgufValue)> = file
        .metadata
        .iter()
        .filter(|(k, _)| {
            !matches!(
                k.as_str(),
                "split.no"
                    | "split.count"
                    | "split.tensors.count"
                    | "general.quantization_version"
                    | "general.file_type"
            )
        })
        .cloned()
        .collect();
    m.push((
        "general.quantization_version".into(),
        GgufValue::U32(QUANTIZATION_VERSION),
    ));
    m.push(("general.file_type".into(), GgufValue::U32(file_type)));
    m
}

/// Quantizes `x` (`rows` rows of `cols`) to `ty`, in parallel over row chunks, optionally with
/// per-column importance weights.
pub fn quantize_rows(
    ty: GgmlType,
    x: &[f32],
    cols: usize,
    weights: Option<&[f32]>,
    name: &str,
) -> Result<Vec<u8>> {
    let rb = ty.row_bytes(cols).ok_or_else(|| {
        Error::Msg(format!(
            "tensor '{name}': rows of {cols} are not whole {ty} blocks"
        ))
    })?;
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(Error::Msg(format!(
            "tensor '{name}': {} values are not whole rows of {cols}",
            x.len()
        )));
    }
    let rows = x.len() / cols;
    let mut out = vec![0u8; rows * rb];
    // Chunks of about 16k values (llama.cpp's min_chunk_size is 32 * 512): big enough to amortise
    // scheduling, small enough to balance on every core.
    let chunk_rows = (16384 / cols).max(1);
    out.par_chunks_mut(chunk_rows * rb)
        .zip(x.par_chunks(chunk_rows * cols))
        .try_for_each(|(dst, src)| -> Result<()> {
            match weights {
                // ggml's MXFP4 quantizer takes no importance weights.
                _ if ty == GgmlType::MXFP4 => quant::quantize(ty, src, dst)?,
                Some(w) => quantize_weighted(ty, src, dst, w)?,
                None => quant::quantize(ty, src, dst)?,
            }
            Ok(())
        })?;
    Ok(out)
}

/// Writes `plan` (in the given order) with `metadata` to `out`. `imatrix` entries (by GGUF name)
/// weight the rounding of the tensors they cover.
pub fn write_gguf(
    src: &SourceModel,
    out: &Path,
    metadata: Vec<(String, GgufValue)>,
    plan: &[GgufPlanEntry],
    imatrix: Option<&Imatrix>,
    progress: &dyn Progress,
) -> Result<WriteReport> {
    let mut w = GgufWriter::new();
    for (k, v) in metadata {
        w.add_metadata(k, v)?;
    }
    for e in plan {
        let t = src
            .tensors
            .get(e.src)
            .ok_or_else(|| Error::Msg("plan names a tensor the source lacks".into()))?;
        let writable = quant::can_quantize(e.to);
        if !writable && Stored::Ggml(e.to) != t.stored {
            return Err(Error::Msg(format!(
                "tensor '{}': cannot write type {}",
                t.gguf, e.to
            )));
        }
        w.add_tensor_info(t.gguf.clone(), t.gguf_dims(), e.to)?;
    }
    let mut report = WriteReport::default();
    progress.start(plan.len());
    let mut i = 0usize;
    let result = w.write_file_with(out, |info| -> hf2q_tensor::Result<Vec<u8>> {
        let e = &plan[i];
        i += 1;
        let t = &src.tensors[e.src];
        let bytes = produce(src, t, e.to, imatrix)
            .map_err(|err| hf2q_tensor::Error::Msg(format!("tensor '{}': {err}", info.name)))?;
        report.tensors.push((
            t.gguf.clone(),
            t.stored.name(),
            e.to.to_string(),
            t.numel() as u64,
            bytes.len() as u64,
        ));
        progress.tensor(i, &t.gguf, &t.stored.name(), &e.to.to_string());
        Ok(bytes)
    });
    progress.finish();
    result?;
    report.bytes_written = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    Ok(report)
}

/// The bytes of one output tensor: copied when the source already holds them, else decoded,
/// re-laid-out and quantized.
pub(crate) fn produce(
    src: &SourceModel,
    t: &super::source::SrcTensor,
    to: GgmlType,
    imatrix: Option<&Imatrix>,
) -> Result<Vec<u8>> {
    if src.layout() == Layout::Gguf {
        if let Some((ty, data)) = src.raw_gguf(t)? {
            if ty == to {
                return Ok(data.as_slice().to_vec());
            }
        }
    }
    if let Some((ty, data)) = src.raw_stacked(t)? {
        if ty == to {
            return Ok(data);
        }
    }
    let x = src.read_f32(t, Layout::Gguf)?;
    let weights = imatrix
        .and_then(|m| m.get(&t.gguf))
        .filter(|w| crate::quantize::imatrix_fits(t, w.len()));
    if t.shape.len() == 3 && t.numel() > 0 {
        // Stacked experts: each expert's rows quantized as its own matrix (ggml's layout is
        // contiguous per expert), with that expert's importance weights where the imatrix has
        // one row per expert, as llama-quantize does.
        let n_experts = t.shape[0];
        let per = t.numel() / n_experts;
        let mut out = Vec::new();
        for (e, xe) in x.chunks(per).enumerate() {
            let we = weights.map(|w| {
                if w.len() == t.cols() {
                    &w[..]
                } else {
                    &w[e * t.cols()..(e + 1) * t.cols()]
                }
            });
            out.extend(quantize_rows(to, xe, t.cols(), we, &t.gguf)?);
        }
        return Ok(out);
    }
    quantize_rows(to, &x, t.cols(), weights, &t.gguf)
}
