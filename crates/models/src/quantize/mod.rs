//! Making a model small: GGUF types chosen per tensor as llama.cpp's presets choose them, MLX
//! affine quantization, importance matrices.
//!
//! - [`presets`]: what `--type` names (llama.cpp file types, pure single types, MLX recipes).
//! - [`rules`]: llama.cpp's per-tensor type rules (`llama_tensor_get_type`).
//! - [`imatrix`]: llama.cpp's GGUF importance-matrix format.
//! - [`collect`]: computing an importance matrix by running a model over a text.
//! - [`mixed`]: per-group types chosen by measured KL under a bits-per-weight budget.
//! - [`sensitivity`]: how far swapping weights moves a loaded model's logits (mixed's measure).
//!
//! The bytes themselves come from `hf2q_tensor::quant` (ggml's quantizers, byte for byte) and are
//! written by `crate::convert`.
//!
//! GPT-OSS: its MXFP4 experts (`ffn_{gate,up,down}_exps`, the only MXFP4 tensors a source holds)
//! stay MXFP4 under every type, their bytes copied as they are (never decoded and quantized
//! again: MXFP4 is the format the model was trained for, as llama.cpp's `MXFP4_MOE` keeps them);
//! every other tensor follows the chosen type's per-tensor rules, which leave the sinks, norms,
//! biases and the router (`ffn_gate_inp`) in their float type as llama-quantize does.

pub mod collect;
pub mod imatrix;
pub mod mixed;
pub mod presets;
pub mod rules;
pub mod sensitivity;

use std::path::Path;

use hf2q_tensor::GgmlType;

use crate::convert::gguf_out::{metadata_from_gguf, write_gguf, GgufPlanEntry, WriteReport};
use crate::convert::source::{SourceModel, SrcTensor, Stored};
use crate::convert::{gguf_meta, mlx_out, Progress};
use crate::{Error, Result};
use imatrix::Imatrix;
use presets::{GgufRecipe, MlxRecipe, QuantTarget};
use rules::{gguf_order, ModelFacts, Overrides, TensorFacts, TypeChooser};

/// Everything `hf2q quantize` needs besides input and output.
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    pub target: QuantTarget,
    pub overrides: Overrides,
    pub imatrix: Option<Imatrix>,
}

/// What a quantization did.
#[derive(Clone, Debug, Default)]
pub struct QuantizeReport {
    pub written: WriteReport,
    /// (tensor, wanted, got) where a row length forced another type.
    pub fallbacks: Vec<rules::Fallback>,
    /// The input held quantized weights, which were decoded and quantized again.
    pub requantized: bool,
    /// Tensors quantized with importance weights.
    pub imatrix_used: usize,
}

/// Facts the per-tensor rules read about a model.
pub fn model_facts(src: &SourceModel) -> ModelFacts {
    ModelFacts::of(&src.config)
}

/// Source tensor indices in llama.cpp's order.
pub fn gguf_tensor_order(src: &SourceModel) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..src.tensors.len()).collect();
    idx.sort_by(|&a, &b| gguf_order(&src.tensors[a].gguf, &src.tensors[b].gguf));
    idx
}

/// The GGUF types of every tensor for `recipe`, in llama.cpp's order.
pub fn plan_gguf(
    src: &SourceModel,
    recipe: GgufRecipe,
    overrides: Overrides,
    has_imatrix: bool,
) -> Result<(Vec<GgufPlanEntry>, Vec<rules::Fallback>)> {
    let order = gguf_tensor_order(src);
    let mut chooser = TypeChooser::new(
        recipe,
        model_facts(src),
        overrides,
        has_imatrix,
        order.iter().map(|&i| src.tensors[i].gguf.as_str()),
    );
    let mut plan = Vec::with_capacity(order.len());
    for i in order {
        let t = &src.tensors[i];
        if keeps_stored_blocks(t) {
            // Not shown to the chooser: no rule or fallback applies to it.
            plan.push(GgufPlanEntry {
                src: i,
                to: GgmlType::MXFP4,
            });
            continue;
        }
        // A tensor that is not quantized keeps its type; float sources store 1-D tensors and
        // routers as F32 in GGUF (as llama.cpp's converter does), MLX affine ones cannot stay
        // affine.
        let current = kept_type(src, t);
        let to = chooser.choose(TensorFacts {
            name: &t.gguf,
            cols: t.cols(),
            n_dims: t.shape.len(),
            current,
        })?;
        plan.push(GgufPlanEntry { src: i, to });
    }
    Ok((plan, chooser.fallbacks))
}

/// Quantizes `src` into `out` (a GGUF file, or an MLX folder for MLX targets).
pub fn quantize(
    src: &SourceModel,
    out: &Path,
    opts: &QuantizeOptions,
    progress: &dyn Progress,
) -> Result<QuantizeReport> {
    let warn_requantized = |requantized: bool| {
        if requantized {
            progress.warn(&format!(
                "{} holds quantized weights: they are decoded and quantized again, which adds the \
                 new format's error to the old one (quantize from the original float checkpoint \
                 when you can)",
                src.path.display()
            ));
        }
        requantized
    };
    match opts.target {
        QuantTarget::Gguf(recipe) => {
            let imatrix = opts.imatrix.as_ref();
            let (plan, fallbacks) = plan_gguf(src, recipe, opts.overrides, imatrix.is_some())?;
            // Only what the plan decodes counts (GPT-OSS's MXFP4 experts are copied).
            let requantized = warn_requantized(plan.iter().any(|e| {
                let t = &src.tensors[e.src];
                !t.stored.is_float() && Stored::Ggml(e.to) != t.stored
            }));
            for (name, want, got) in &fallbacks {
                let cols = src.tensor_by_gguf(name).map(|t| t.cols()).unwrap_or(0);
                progress.warn(&format!(
                    "{name}: rows of {cols} are not whole {want} blocks ({}): {got} instead",
                    want.block_size()
                ));
            }
            let imatrix_used = match imatrix {
                Some(m) => plan
                    .iter()
                    .filter(|e| {
                        let t = &src.tensors[e.src];
                        m.get(&t.gguf).is_some_and(|w| imatrix_fits(t, w.len()))
                            && Stored::Ggml(e.to) != t.stored
                    })
                    .count(),
                None => 0,
            };
            if let Some(m) = imatrix {
                check_imatrix(src, &plan, m)?;
            }
            let mut metadata = match src.gguf_file() {
                Some(f) => metadata_from_gguf(f, recipe.preset.ftype()),
                None => gguf_meta::metadata_from_hf(src, recipe.preset.ftype())?,
            };
            if let Some(m) = imatrix {
                // Replaced where the source already has them (re-quantizing a quantized file),
                // appended otherwise, as llama.cpp's gguf_set_val does.
                for (k, v) in m.provenance() {
                    metadata.retain(|(key, _)| *key != k);
                    metadata.push((k, v));
                }
            }
            let written = write_gguf(src, out, metadata, &plan, imatrix, progress)?;
            Ok(QuantizeReport {
                written,
                fallbacks,
                requantized,
                imatrix_used,
            })
        }
        QuantTarget::Mlx(MlxRecipe { params }) => {
            let requantized = warn_requantized(src.is_quantized());
            let imatrix = opts.imatrix.as_ref();
            // The tensors mlx_out quantizes: 2-D weights whose rows are whole groups.
            let quantized = |t: &&SrcTensor| {
                t.shape.len() == 2
                    && t.hf.ends_with(".weight")
                    && t.cols().is_multiple_of(params.group_size)
            };
            let imatrix_used = match imatrix {
                Some(m) => {
                    check_imatrix_entries(src.tensors.iter().filter(quantized), m)?;
                    src.tensors
                        .iter()
                        .filter(quantized)
                        .filter(|t| m.get(&t.gguf).is_some_and(|w| w.len() == t.cols()))
                        .count()
                }
                None => 0,
            };
            let written = mlx_out::write_mlx_weighted(
                src,
                out,
                &mlx_out::MlxOptions {
                    params,
                    overrides: Default::default(),
                    dtype: None,
                },
                imatrix,
                progress,
            )?;
            Ok(QuantizeReport {
                written,
                fallbacks: Vec::new(),
                requantized,
                imatrix_used,
            })
        }
    }
}

/// Whether an imatrix entry of `n` values fits `t`: one value per column, or for stacked experts
/// `(E, R, C)` one row of C per expert (llama.cpp's layout for `_exps` entries).
pub fn imatrix_fits(t: &SrcTensor, n: usize) -> bool {
    n == t.cols() || (t.shape.len() == 3 && n == t.shape[0] * t.cols())
}

/// llama.cpp refuses an imatrix entry whose length disagrees with its tensor (except for the
/// token embeddings, which no matmul reads): a sign the imatrix belongs to another model.
fn check_imatrix(src: &SourceModel, plan: &[GgufPlanEntry], m: &Imatrix) -> Result<()> {
    check_imatrix_entries(plan.iter().map(|e| &src.tensors[e.src]), m)
}

fn check_imatrix_entries<'a>(
    tensors: impl Iterator<Item = &'a SrcTensor>,
    m: &Imatrix,
) -> Result<()> {
    for t in tensors {
        if let Some(w) = m.get(&t.gguf) {
            if !imatrix_fits(t, w.len()) && t.gguf != "token_embd.weight" {
                return Err(Error::Msg(format!(
                    "imatrix entry for {} has {} values but the tensor's rows have {} (is the imatrix for another model?)",
                    t.gguf,
                    w.len(),
                    t.cols()
                )));
            }
        }
    }
    Ok(())
}

/// Whether a tensor keeps its stored blocks under every quantization type: GPT-OSS's MXFP4
/// experts (`(E, R, C)`, 17 bytes per 32 values), whose bytes `gguf_out::produce` copies.
pub fn keeps_stored_blocks(t: &SrcTensor) -> bool {
    t.stored == Stored::Ggml(GgmlType::MXFP4)
}

/// The GGUF type of a tensor that is not quantized: a GGUF source's own; from a folder, F32 for
/// vectors and for a router `ffn_gate_inp` (llama.cpp's converter always writes those in F32),
/// the stored float type otherwise; MLX affine weights F16.
fn kept_type(src: &SourceModel, t: &SrcTensor) -> GgmlType {
    match t.stored {
        Stored::Ggml(_)
            if src.gguf_file().is_none()
                && (t.shape.len() == 1 || t.gguf.contains("ffn_gate_inp")) =>
        {
            GgmlType::F32
        }
        Stored::Ggml(ty) => ty,
        Stored::Affine(_) => GgmlType::F16,
    }
}

/// Every tensor in its own type (a lossless GGUF conversion): ggml types stay, 1-D tensors and
/// routers of a float folder become F32 (as llama.cpp's converter writes them), MLX affine
/// weights F16.
pub fn plan_gguf_keep(src: &SourceModel) -> Vec<GgufPlanEntry> {
    gguf_tensor_order(src)
        .into_iter()
        .map(|i| GgufPlanEntry {
            src: i,
            to: kept_type(src, &src.tensors[i]),
        })
        .collect()
}

/// `general.file_type` for a kept-type plan: the source's own for a GGUF, else what the 2-D
/// tensors mostly are (F32, F16 or BF16).
pub fn file_type_of(src: &SourceModel, plan: &[GgufPlanEntry]) -> u32 {
    if let Some(ft) = src.gguf_file().and_then(|f| f.get_u64("general.file_type")) {
        return ft as u32;
    }
    file_type_of_plan(src, plan)
}

/// The llama.cpp file type whose base type most 2-D tensors of `plan` have (F16 when none).
pub fn file_type_of_plan(src: &SourceModel, plan: &[GgufPlanEntry]) -> u32 {
    let mut counts = std::collections::HashMap::new();
    for e in plan.iter().filter(|e| src.tensors[e.src].shape.len() >= 2) {
        *counts.entry(e.to).or_insert(0usize) += 1;
    }
    let main = counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(t, _)| t)
        .unwrap_or(GgmlType::F32);
    presets::Preset::all()
        .find(|p| p.default_type() == main)
        .map(|p| p.ftype())
        .unwrap_or(1)
}
