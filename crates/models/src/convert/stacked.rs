//! The stacked routed-experts tensors of a folder source (`SourceModel`'s listing and reads):
//! per routed layer `mlp.experts.{gate,up,down}_proj.weight` `(E, R, C)` read from the
//! checkpoint's per-expert or fused tensors, or (GPT-OSS) from its MXFP4 blocks, whose repacked
//! bytes are copied as they are ([`SourceModel::raw_stacked`]), with the products' biases
//! `mlp.experts.*_proj.bias` `(E, R)` (llama.cpp's `ffn_*_exps.bias`).

use hf2q_tensor::GgmlType;
use rayon::prelude::*;

use super::source::{stacked_expert, SourceModel, SrcTensor, Stored, EXPERT_PARTS};
use crate::config::{Arch, ModelConfig};
use crate::names::hf_to_gguf;
use crate::source::WeightSource;
use crate::{Error, Result};

impl SourceModel {
    /// A stacked experts tensor `(E, R, C)` of a folder source: each expert's matrix (per-expert
    /// or fused in the checkpoint) decoded into its place, experts in parallel.
    pub(super) fn read_stacked_experts(&self, t: &SrcTensor) -> Result<Vec<f32>> {
        let (layer, part) = stacked_expert(&t.hf).ok_or_else(|| {
            Error::Config(format!(
                "tensor '{}' has 3 dims and is not a stacked experts tensor",
                t.hf
            ))
        })?;
        let n_experts = t.shape[0];
        let ex = layer_experts(&self.weights, &self.config, layer, n_experts)?;
        let per = t.numel() / n_experts.max(1);
        let mut out = vec![0f32; t.numel()];
        out.par_chunks_mut(per.max(1))
            .enumerate()
            .try_for_each(|(e, dst)| -> Result<()> {
                let v = ex.expert(e)[part].to_f32()?;
                if v.len() != dst.len() {
                    return Err(Error::Config(format!(
                        "tensor '{}': expert {e} has {} values, {} expected",
                        t.hf,
                        v.len(),
                        dst.len()
                    )));
                }
                dst.copy_from_slice(&v);
                Ok(())
            })?;
        Ok(out)
    }
}

impl SourceModel {
    /// The `(E, F)` / `(E, D)` biases of a stacked experts part (GPT-OSS), expert after expert.
    pub(super) fn read_expert_biases(&self, t: &SrcTensor) -> Result<Vec<f32>> {
        let (layer, part) = stacked_expert_bias(&t.hf)
            .ok_or_else(|| Error::Config(format!("tensor '{}' is not an experts bias", t.hf)))?;
        let n_experts = t.shape[0];
        let ex = layer_experts(&self.weights, &self.config, layer, n_experts)?;
        let mut out = Vec::with_capacity(t.numel());
        for e in 0..n_experts {
            let b = ex
                .biases(e)
                .ok_or_else(|| Error::MissingTensor(t.hf.clone()))?;
            out.extend_from_slice(b[part]);
        }
        Ok(out)
    }

    /// The stored bytes of a folder's stacked experts tensor when its experts are already in a
    /// ggml block type (GPT-OSS's MXFP4, repacked at read): copied as they are, never decoded.
    pub fn raw_stacked(&self, t: &SrcTensor) -> Result<Option<(GgmlType, Vec<u8>)>> {
        let (Some((layer, part)), WeightSource::St { .. }, false) = (
            stacked_expert(&t.hf),
            &self.weights,
            self.deltas.contains_key(&t.hf),
        ) else {
            return Ok(None);
        };
        if self.config.arch != Arch::GptOss {
            return Ok(None);
        }
        let ex = layer_experts(&self.weights, &self.config, layer, t.shape[0])?;
        let mut ty = None;
        let mut out = Vec::new();
        for e in 0..t.shape[0] {
            let hf2q_tensor::WeightData::Ggml { ty: et, data } = &ex.expert(e)[part].data else {
                return Ok(None);
            };
            ty = Some(*et);
            out.extend_from_slice(data.as_slice());
        }
        Ok(ty.map(|ty| (ty, out)))
    }
}

/// The stacked expert tensors of routed layer `layer` of a folder source, shaped and typed from
/// its first expert (the per-expert or fused tensors are read by [`SourceModel::read_f32`]).
pub(super) fn stacked_tensors(
    weights: &WeightSource,
    config: &ModelConfig,
    layer: usize,
    n_experts: usize,
) -> Result<Vec<SrcTensor>> {
    let ex = layer_experts(weights, config, layer, n_experts)?;
    let mut out: Vec<SrcTensor> = EXPERT_PARTS
        .iter()
        .enumerate()
        .map(|(p, part)| {
            let hf = format!("model.layers.{layer}.mlp.experts.{part}.weight");
            let v = &ex.expert(0)[p];
            let hf2q_tensor::WeightData::Ggml { ty, .. } = v.data else {
                return Err(Error::Config(format!(
                    "{hf}: quantized (MLX) experts cannot be converted yet"
                )));
            };
            let gguf = hf_to_gguf(config.arch, &hf)
                .ok_or_else(|| Error::Msg(format!("{hf}: no GGUF name in hf2q's table")))?;
            Ok(SrcTensor {
                hf,
                gguf,
                shape: vec![n_experts, v.rows, v.cols],
                stored: Stored::Ggml(ty),
            })
        })
        .collect::<Result<_>>()?;
    if let Some(b) = ex.biases(0) {
        // GPT-OSS's expert biases: `(E, F)` / `(E, D)` as llama.cpp's `ffn_*_exps.bias`.
        for (p, part) in EXPERT_PARTS.iter().enumerate() {
            let hf = format!("model.layers.{layer}.mlp.experts.{part}.bias");
            let gguf = hf_to_gguf(config.arch, &hf)
                .ok_or_else(|| Error::Msg(format!("{hf}: no GGUF name in hf2q's table")))?;
            out.push(SrcTensor {
                hf,
                gguf,
                shape: vec![n_experts, b[p].len()],
                stored: Stored::Ggml(GgmlType::F32),
            });
        }
    }
    Ok(out)
}

/// The routed experts of `layer` of a folder source, by the family's own reader.
fn layer_experts(
    weights: &WeightSource,
    config: &ModelConfig,
    layer: usize,
    n_experts: usize,
) -> Result<hf2q_tensor::moe::Experts> {
    let prefix = format!("model.layers.{layer}");
    if config.arch == Arch::GptOss {
        weights.gpt_oss_experts(&prefix, n_experts)
    } else {
        weights.experts(&prefix, n_experts)
    }
}

/// `(layer, part)` of a stacked experts bias's HF name
/// (`model.layers.N.mlp.experts.{gate,up,down}_proj.bias`, GPT-OSS).
pub(super) fn stacked_expert_bias(hf: &str) -> Option<(usize, usize)> {
    stacked_expert(&format!("{}.weight", hf.strip_suffix(".bias")?))
}
