//! Mixed precision by measured sensitivity (`hf2q quantize --target-bpw B --calib TEXT`).
//!
//! 1. **Groups.** The quantizable weights are grouped: the embeddings (with the output matrix
//!    when it is tied), the output matrix, and per layer its attention matrices (q, k, v, o)
//!    and its MLP matrices (gate, up, down).
//! 2. **Ladder.** Every group can sit at one level of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0; a
//!    tensor whose rows do not split into that type's blocks takes llama.cpp's fallback type
//!    (so SmolLM2's 576-wide matrices climb Q4_0, Q5_0, Q5_1, Q8_0).
//! 3. **Measure.** For each group, the source model (loaded once, on the fast CPU kernels or a
//!    GPU) gets only that group's weights replaced by the bytes the output file would store at
//!    a level, runs teacher-forced over the calibration tokens, and the mean KL(source ||
//!    variant) per token is recorded ([`super::sensitivity`]: no file is written, and the
//!    network before the group's layer runs once for all groups). By default one level is
//!    measured per group (its cheapest, where the signal is largest) and the other levels' KL
//!    is scaled from it by the group's weight quantization error (KL of a small perturbation
//!    grows with its square, which the summed squared error tracks); `exhaustive` measures
//!    every level.
//! 4. **Spend.** Starting from the floors (embeddings, output, first and last layer at Q3_K or
//!    better: llama.cpp's presets protect them too), the budget `B x parameters / 8` bytes is
//!    spent greedily on the upgrade that removes the most measured KL per byte, until no upgrade
//!    fits. KL is treated as additive over groups (a first-order approximation that holds for
//!    small perturbations).
//!
//! The result is a per-tensor GGUF plan and an allocation table. Measuring costs one forward per
//! (group, measured level), from the group's layer on: keep the calibration text short (a few
//! hundred tokens).

use std::path::Path;
use std::sync::Arc;

use hf2q_cpu::MatmulPath;
use hf2q_cuda::backend::CudaBackend;
use hf2q_tensor::{Bytes, GgmlType, QTensor};

use super::rules::{allows_quantization, fallback_type};
use super::sensitivity::Sensitivity;
use super::{gguf_tensor_order, plan_gguf_keep};
use crate::convert::gguf_out::{
    metadata_from_gguf, produce, quantize_rows, write_gguf, GgufPlanEntry,
};
use crate::convert::source::{dequantize_rows, Layout, SourceModel, SrcTensor, Stored};
use crate::convert::{gguf_meta, Progress};
use crate::{Error, Model, Result};

/// The types a group climbs through, cheapest first.
pub const LADDER: [GgmlType; 6] = [
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
];

/// Index of Q3_K in [`LADDER`]: the floor of protected groups (no 2-bit embeddings, output, or
/// first or last layer). A higher floor (Q4_K) costs too much where the embeddings are a large
/// share of the model: on SmolLM2-135M (embeddings 21% of the weights) a Q4_K-level floor at
/// 4.5 bits per weight left only Q2_K for the MLP down projections and measured worse.
const FLOOR_PROTECTED: usize = 1;

#[derive(Clone, Debug)]
pub struct MixedOptions {
    /// Bits per weight over every tensor (what llama.cpp prints as BPW).
    pub target_bpw: f64,
    /// Calibration tokens (one sequence, teacher-forced).
    pub calib: Vec<u32>,
    /// Measure every (group, level) instead of one level per group.
    pub exhaustive: bool,
    /// The CPU matmul path of the measurement forwards.
    pub matmul: MatmulPath,
    /// Measure on this GPU instead of the CPU.
    pub cuda: Option<Arc<CudaBackend>>,
}

impl MixedOptions {
    /// One measured level per group, on the CPU's fast kernels.
    pub fn new(target_bpw: f64, calib: Vec<u32>) -> MixedOptions {
        MixedOptions {
            target_bpw,
            calib,
            exhaustive: false,
            matmul: MatmulPath::Fast,
            cuda: None,
        }
    }
}

/// One group's outcome.
#[derive(Clone, Debug)]
pub struct GroupAllocation {
    pub name: String,
    /// Types of the group's tensors at the chosen level (distinct, in tensor order).
    pub types: Vec<GgmlType>,
    pub level: usize,
    /// Measured KL with only this group quantized at the chosen level.
    pub kl: f64,
    pub bytes: u64,
}

#[derive(Clone, Debug)]
pub struct Allocation {
    pub groups: Vec<GroupAllocation>,
    pub bits_per_weight: f64,
    /// Sum of the groups' measured KL: the first-order estimate of the whole model's KL.
    pub estimated_kl: f64,
}

struct Group {
    name: String,
    /// Indices into `src.tensors`.
    members: Vec<usize>,
    floor: usize,
    /// Per level: resolved types per member, bytes, measured KL.
    types: Vec<Vec<GgmlType>>,
    bytes: Vec<u64>,
    kl: Vec<f64>,
    /// Summed squared quantization error of the group's weights, per level.
    sse: Vec<f64>,
}

fn group_of(name: &str, n_layers: usize, tied: bool) -> Option<(String, bool)> {
    if name == "token_embd.weight" {
        return Some(("token_embd".into(), true));
    }
    if name == "output.weight" {
        return Some(("output".into(), !tied));
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let l: usize = layer.parse().ok()?;
    let kind = if part.starts_with("attn") {
        "attn"
    } else if part.starts_with("ffn") {
        "ffn"
    } else {
        return None;
    };
    Some((format!("blk.{l}.{kind}"), l == 0 || l + 1 == n_layers))
}

/// Where a group comes in the measuring order: the embeddings, the layers in order, the output.
fn block_order(group: &str, n_layers: usize) -> usize {
    match group {
        "token_embd" => 0,
        "output" => n_layers + 1,
        g => g
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, _)| l.parse::<usize>().ok())
            .map_or(n_layers + 1, |l| l + 1),
    }
}

/// The bytes of `t` at `ty` as the output file stores them, in the source's layout (`x`: its
/// values in that layout). Rows are quantized one by one, so the Hugging Face layout's bytes
/// are the file's (GGUF layout) rows in another order.
pub fn stored_bytes(src: &SourceModel, t: &SrcTensor, x: &[f32], ty: GgmlType) -> Result<Vec<u8>> {
    match src.layout() {
        Layout::Gguf => produce(src, t, ty, None),
        Layout::Hf => quantize_rows(ty, x, t.cols(), None, &t.gguf),
    }
}

/// Every how many rows a matrix's quantization error is summed over (rows 0, 8, 16, ...). The
/// error only scales a group's measured KL from its measured level to the others (a ratio of
/// two levels' errors over the same rows); an eighth of the rows gives the allocation of all of
/// them on SmolLM2 (see BENCHMARKS.md) for an eighth of the quantizing of the levels not
/// measured.
const SSE_STRIDE: usize = 8;

/// The rows of `x (R, C)` the error is summed over, `(ceil(R / SSE_STRIDE), C)`.
fn sampled_rows(x: &[f32], cols: usize) -> Vec<f32> {
    x.chunks(cols)
        .step_by(SSE_STRIDE)
        .flatten()
        .copied()
        .collect()
}

/// Summed squared quantization error at `ty` of `t`'s sampled rows `x` ([`sampled_rows`]): read
/// from `full` (all of `t`'s rows at `ty`) when given, else quantized now.
fn sampled_error(
    src: &SourceModel,
    t: &SrcTensor,
    x: &[f32],
    ty: GgmlType,
    full: Option<&Bytes>,
) -> Result<f64> {
    if src.layout() == Layout::Gguf && t.stored == Stored::Ggml(ty) {
        // The file copies the stored bytes, which the values were read from.
        return Ok(0.0);
    }
    let cols = t.cols();
    let rows = x.len() / cols;
    let q = match full {
        Some(d) => {
            let rb = ty.row_bytes(cols).unwrap_or(0).max(1);
            d.as_slice()
                .chunks(rb)
                .step_by(SSE_STRIDE)
                .flatten()
                .copied()
                .collect()
        }
        None => quantize_rows(ty, x, cols, None, &t.gguf)?,
    };
    let y = dequantize_rows(ty, &q, rows, cols, &t.gguf)?;
    Ok(x.iter()
        .zip(&y)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum())
}

/// Measures every group's sensitivity and chooses a level per group within the budget.
pub fn plan_mixed(
    src: &SourceModel,
    opts: &MixedOptions,
    progress: &dyn Progress,
) -> Result<(Vec<GgufPlanEntry>, Allocation)> {
    if opts.calib.len() < 2 {
        return Err(Error::Msg(
            "mixed precision needs at least 2 calibration tokens".into(),
        ));
    }
    if !src.deltas.is_empty() {
        return Err(Error::Msg(
            "mixed precision measures the model as stored; fuse the adapter into a checkpoint first"
                .into(),
        ));
    }
    let base_plan = plan_gguf_keep(src);
    let tied = src.tensor_by_gguf("output.weight").is_none();
    let mut groups: Vec<Group> = Vec::new();
    for &i in &gguf_tensor_order(src) {
        let t = &src.tensors[i];
        // GPT-OSS's MXFP4 experts keep their blocks at every level (counted in `fixed`).
        if !allows_quantization(&t.gguf, t.shape.len()) || super::keeps_stored_blocks(t) {
            continue;
        }
        let Some((name, protected)) = group_of(&t.gguf, src.config.n_layers, tied) else {
            continue;
        };
        let floor = if protected { FLOOR_PROTECTED } else { 0 };
        match groups.iter_mut().find(|g| g.name == name) {
            Some(g) => g.members.push(i),
            None => groups.push(Group {
                name,
                members: vec![i],
                floor,
                types: Vec::new(),
                bytes: Vec::new(),
                kl: Vec::new(),
                sse: Vec::new(),
            }),
        }
    }
    for g in &mut groups {
        for ty in LADDER {
            let mut types = Vec::new();
            let mut bytes = 0u64;
            for &i in &g.members {
                let t = &src.tensors[i];
                let r = fallback_type(&t.gguf, t.cols(), ty)?;
                bytes += (r.row_bytes(t.cols()).unwrap_or(0) * t.rows()) as u64;
                types.push(r);
            }
            g.types.push(types);
            g.bytes.push(bytes);
        }
    }
    // Bytes that no choice changes (norms, biases, unquantizable tensors).
    let in_group = |i: usize| groups.iter().any(|g| g.members.contains(&i));
    let fixed: u64 = base_plan
        .iter()
        .filter(|e| !in_group(e.src))
        .map(|e| {
            let t = &src.tensors[e.src];
            (e.to.row_bytes(t.cols()).unwrap_or(0) * t.rows()) as u64
        })
        .sum();
    let n_params: u64 = src.tensors.iter().map(|t| t.numel() as u64).sum();
    let budget = (opts.target_bpw * n_params as f64 / 8.0) as u64;
    let floor_bytes: u64 = fixed + groups.iter().map(|g| g.bytes[g.floor]).sum::<u64>();
    if floor_bytes > budget {
        return Err(Error::Msg(format!(
            "--target-bpw {} is below what this model can reach with its floors (embeddings, output, first and last layer at Q3_K or its fallback): {:.3} bits per weight",
            opts.target_bpw,
            floor_bytes as f64 * 8.0 / n_params as f64
        )));
    }

    // Measure, in block order (each measurement reuses the base prefix of the one before).
    let mut model = Model::load(&src.path)?;
    model.set_matmul_path(opts.matmul);
    model.set_cuda(opts.cuda.clone())?;
    let mut sens = Sensitivity::new(model, opts.calib.clone())?;
    let layout = src.layout();
    let n_layers = src.config.n_layers;
    let distinct = |g: &Group, l: usize| l == 0 || g.types[l] != g.types[l - 1];
    let total: usize = if opts.exhaustive {
        groups
            .iter()
            .map(|g| (0..LADDER.len()).filter(|&l| distinct(g, l)).count())
            .sum()
    } else {
        groups.len()
    };
    let mut order: Vec<usize> = (0..groups.len()).collect();
    order.sort_by_key(|&gi| block_order(&groups[gi].name, n_layers));
    progress.start(total);
    let mut done = 0;
    for gi in order {
        let g = &mut groups[gi];
        // Per member: its values in the model's layout, and per type met so far its stored
        // bytes and their squared error (each (tensor, type) is quantized once).
        let xs: Vec<Vec<f32>> = g
            .members
            .iter()
            .map(|&i| src.read_f32(&src.tensors[i], layout))
            .collect::<Result<_>>()?;
        let samples: Vec<Vec<f32>> = xs
            .iter()
            .zip(&g.members)
            .map(|(x, &i)| sampled_rows(x, src.tensors[i].cols()))
            .collect();
        let mut made: Vec<Vec<(GgmlType, Option<Bytes>, f64)>> = vec![Vec::new(); g.members.len()];
        #[allow(clippy::needless_range_loop)] // l indexes several per-level vectors
        for l in 0..LADDER.len() {
            if !distinct(g, l) {
                let (k, e) = (g.kl[l - 1], g.sse[l - 1]);
                g.kl.push(k);
                g.sse.push(e);
                continue;
            }
            let measure = opts.exhaustive || l == 0;
            let mut sse = 0f64;
            let mut weights = Vec::new();
            for (k, (&i, &ty)) in g.members.iter().zip(&g.types[l]).enumerate() {
                let t = &src.tensors[i];
                let at = match made[k].iter().position(|m| m.0 == ty) {
                    Some(at) => at,
                    None => {
                        made[k].push((ty, None, f64::NAN));
                        made[k].len() - 1
                    }
                };
                let entry = &mut made[k][at];
                if measure && entry.1.is_none() {
                    entry.1 = Some(Bytes::from_vec(stored_bytes(src, t, &xs[k], ty)?));
                }
                if !opts.exhaustive && entry.2.is_nan() {
                    entry.2 = sampled_error(src, t, &samples[k], ty, entry.1.as_ref())?;
                }
                sse += entry.2;
                if let (true, Some(data)) = (measure, &entry.1) {
                    let w = QTensor::ggml(&t.gguf, ty, t.rows(), t.cols(), data.clone())?;
                    weights.push((t.hf.clone(), w));
                }
            }
            g.sse.push(sse);
            if !measure {
                // Scaled from the measured cheapest level by the squared weight error.
                let k = if g.sse[0] > 0.0 {
                    g.kl[0] * g.sse[l] / g.sse[0]
                } else {
                    0.0
                };
                g.kl.push(k);
                continue;
            }
            g.kl.push(sens.kl(weights)?);
            done += 1;
            progress.tensor(
                done,
                &g.name,
                &src.tensors[g.members[0]].stored.name(),
                &format!("{} (KL {:.5})", LADDER[l], g.kl[l]),
            );
        }
    }
    progress.finish();

    // Spend the budget.
    let mut level: Vec<usize> = groups.iter().map(|g| g.floor).collect();
    let mut used = floor_bytes;
    loop {
        let mut best: Option<(usize, usize, f64)> = None;
        for (gi, g) in groups.iter().enumerate() {
            let cur = level[gi];
            // The next level that costs more bytes (equal-byte levels are the same types).
            let Some(next) = (cur + 1..LADDER.len()).find(|&l| g.bytes[l] > g.bytes[cur]) else {
                continue;
            };
            let cost = g.bytes[next] - g.bytes[cur];
            if used + cost > budget {
                continue;
            }
            let gain = g.kl[cur] - g.kl[next];
            let ratio = gain / cost as f64;
            if gain > 0.0 && best.is_none_or(|b| ratio > b.2) {
                best = Some((gi, next, ratio));
            }
        }
        let Some((gi, next, _)) = best else { break };
        used += groups[gi].bytes[next] - groups[gi].bytes[level[gi]];
        level[gi] = next;
    }

    let mut plan = base_plan;
    let mut out = Vec::new();
    for (g, &l) in groups.iter().zip(&level) {
        for (&m, &ty) in g.members.iter().zip(&g.types[l]) {
            if let Some(e) = plan.iter_mut().find(|e| e.src == m) {
                e.to = ty;
            }
        }
        let mut types = g.types[l].clone();
        types.dedup();
        out.push(GroupAllocation {
            name: g.name.clone(),
            types,
            level: l,
            kl: g.kl[l],
            bytes: g.bytes[l],
        });
    }
    let estimated_kl = out.iter().map(|g| g.kl).sum();
    Ok((
        plan,
        Allocation {
            groups: out,
            bits_per_weight: used as f64 * 8.0 / n_params as f64,
            estimated_kl,
        },
    ))
}

/// Writes a mixed-precision GGUF: [`plan_mixed`] (its measurements on `measure`), then the file
/// (on `write`; its `general.file_type` is the llama.cpp preset whose base type most weights
/// got).
pub fn quantize_mixed(
    src: &SourceModel,
    out: &Path,
    opts: &MixedOptions,
    measure: &dyn Progress,
    write: &dyn Progress,
) -> Result<(crate::convert::gguf_out::WriteReport, Allocation)> {
    let (plan, alloc) = plan_mixed(src, opts, measure)?;
    let file_type = super::file_type_of_plan(src, &plan);
    let metadata = match src.gguf_file() {
        Some(f) => metadata_from_gguf(f, file_type),
        None => gguf_meta::metadata_from_hf(src, file_type)?,
    };
    let report = write_gguf(src, out, metadata, &plan, None, write)?;
    Ok((report, alloc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_and_floors() {
        assert_eq!(
            group_of("token_embd.weight", 30, true),
            Some(("token_embd".into(), true))
        );
        assert_eq!(
            group_of("blk.0.attn_q.weight", 30, true),
            Some(("blk.0.attn".into(), true))
        );
        assert_eq!(
            group_of("blk.7.ffn_down.weight", 30, true),
            Some(("blk.7.ffn".into(), false))
        );
        assert_eq!(
            group_of("blk.29.ffn_up.weight", 30, true),
            Some(("blk.29.ffn".into(), true))
        );
        assert_eq!(
            group_of("blk.3.attn_norm.weight", 30, true).map(|g| g.0),
            Some("blk.3.attn".into())
        );
        assert_eq!(group_of("rope_freqs.weight", 30, true), None);
    }
}
